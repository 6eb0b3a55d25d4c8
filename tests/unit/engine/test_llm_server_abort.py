"""LLMServer ends a request whose abort overtook it (a rank actor's caller cancels and aborts by
id; either may reach the rank before the request is in the engine)."""

from __future__ import annotations

import asyncio

from deployments.engine.llm_server import LLMServer
from deployments.records import EngineRequest, SamplingSpec, TokenDelta
from tests.unit.ingress_fakes import FakeMetricsBackend


class AddingEngine:
    """VLLMEngine's interface, with vLLM's race: a request is registered only once `added` is
    set, and an abort of an id not registered yet does nothing."""

    max_model_len = 2048

    def __init__(self):
        self.added = asyncio.Event()
        self.registered: set[str] = set()
        self.aborted: list[str] = []
        self.calls = 0

    async def generate(self, request):
        self.calls += 1
        await self.added.wait()
        self.registered.add(request.request_id)
        for i in range(1000):
            if request.request_id not in self.registered:
                return  # aborted
            yield TokenDelta("t", [i], None, 3, i + 1)
            await asyncio.sleep(0)

    async def abort(self, request_id):
        self.aborted.append(request_id)
        self.registered.discard(request_id)

    def unfinished_requests(self):
        return len(self.registered)

    def shutdown(self):
        pass


def make_server():
    engine = AddingEngine()
    server = LLMServer({"name": "m", "max_model_len": 2048}, {"stream_interval_ms": 0}, "/ckpt",
                       engine_factory=lambda *a, **k: engine, metrics_backend=FakeMetricsBackend())
    return server, engine


REQUEST = EngineRequest("r-1-abcd1234", [1, 2, 3], SamplingSpec(max_tokens=1000))


def test_an_abort_that_arrives_first_means_the_request_never_reaches_the_engine():
    server, engine = make_server()

    async def scenario():
        await server.abort(REQUEST.request_id)
        return [d async for d in server.generate(REQUEST)]

    assert asyncio.run(scenario()) == []
    assert engine.calls == 0 and server._stats.aborted_total == 1


def test_an_abort_while_the_engine_is_still_adding_the_request_ends_it_at_its_first_output():
    server, engine = make_server()

    async def scenario():
        items: list = []

        async def consume():  # a stream nobody cancels: its Ray cancel was lost
            async for delta in server.generate(REQUEST):
                items.append(delta)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        await server.abort(REQUEST.request_id)  # finds nothing to abort in the engine yet
        assert engine.unfinished_requests() == 0
        engine.added.set()
        await asyncio.wait_for(task, 2)
        return items

    items = asyncio.run(scenario())
    assert items == []  # ended before it streamed anything
    assert engine.unfinished_requests() == 0
    assert engine.aborted == [REQUEST.request_id, REQUEST.request_id]
    assert server._stats.aborted_total == 1 and server._stats.finished_total == 0


def test_other_requests_are_not_touched_by_an_abort():
    server, engine = make_server()
    engine.added.set()

    async def scenario():
        await server.abort("someone-else")
        stream = server.generate(REQUEST)
        first = await anext(stream)
        await stream.aclose()
        return first

    assert asyncio.run(scenario()).token_ids == [0]
    assert engine.aborted == ["someone-else", REQUEST.request_id]
