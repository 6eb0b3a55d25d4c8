"""An engine replica's routing report counts the prompt tokens it has yet to prefill: what a
token-aware router weighs (deployments/routing/policies.py, `prompt_tokens_per_request`)."""

from __future__ import annotations

import asyncio

from deployments.records import EngineRequest, SamplingSpec
from tests.unit.engine.test_llm_server_abort import make_server


def test_prompt_tokens_count_until_the_first_output_and_not_after():
    server, engine = make_server()
    long_prompt = EngineRequest("r-long-abcd1234", list(range(5000)), SamplingSpec(max_tokens=3))
    short_prompt = EngineRequest("r-short-abcd1234", [1, 2, 3], SamplingSpec(max_tokens=3))

    async def scenario():
        firsts: dict[str, asyncio.Event] = {r.request_id: asyncio.Event() for r in (long_prompt, short_prompt)}

        async def consume(request):
            async for _delta in server.generate(request):
                firsts[request.request_id].set()

        tasks = [asyncio.ensure_future(consume(r)) for r in (long_prompt, short_prompt)]
        await asyncio.sleep(0.01)  # both in the engine, neither prefilled (the engine waits on `added`)
        before = server.record_routing_stats()
        engine.added.set()
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts.values())), 5)
        during = server.record_routing_stats()  # both decoding now
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return before, during, server.record_routing_stats()

    before, during, after = asyncio.run(scenario())
    assert before["prompt_tokens_pending"] == 5003 and before["in_flight"] == 2
    assert during["prompt_tokens_pending"] == 0 and during["in_flight"] == 2
    assert after["prompt_tokens_pending"] == 0 and after["in_flight"] == 0
