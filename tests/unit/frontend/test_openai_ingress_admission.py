"""Admission control at the ingress: a bounded number in flight, then 429 with Retry-After at
once; places are given back however a request ends; priorities are shed low first."""

import asyncio
import time

import httpx
from starlette.applications import Starlette
from starlette.routing import Route

from deployments.frontend.openai_ingress import OpenAIIngress
from tests.unit.ingress_fakes import HELLO, HTTP, MODEL, front_end

LIMITS = {"max_running": 1, "max_queued": 1, "max_retry_s": 30}


class GatedEngine:
    """Every stream waits for `open` before it yields the scripted reply."""

    def __init__(self):
        self.open = asyncio.Event()
        self.started = 0

    async def stream(self, request, **_options):
        self.started += 1
        await self.open.wait()
        for item in HELLO:
            yield item

    async def health(self, timeout_s):
        return None


def app_for(engine, **options):
    ingress = OpenAIIngress(engine, MODEL, HTTP, model_path="unused", front=front_end(), **options)

    async def endpoint(request):
        return await ingress(request)

    app = Starlette(routes=[Route("/{path:path}", endpoint, methods=["GET", "POST"])])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress"), ingress


def complete(client, **headers):
    return client.post("/v1/completions", json={"model": MODEL["name"], "prompt": "hi"}, headers=headers)


async def _wait_until(predicate):
    for _ in range(200):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never became true")


def test_past_the_bound_requests_get_429_with_retry_after_at_once_and_the_admitted_finish():
    async def scenario():
        engine = GatedEngine()
        client, ingress = app_for(engine, admission=LIMITS)
        async with client:
            admitted = [asyncio.create_task(complete(client)) for _ in range(2)]
            await _wait_until(lambda: engine.started == 2)
            started = time.monotonic()
            rejected = await complete(client)
            rejected_after_s = time.monotonic() - started
            engine.open.set()
            done = await asyncio.gather(*admitted)
            after = await complete(client)  # places were given back
        return rejected, rejected_after_s, done, after, ingress

    rejected, rejected_after_s, done, after, ingress = asyncio.run(scenario())
    assert rejected.status_code == 429 and rejected_after_s < 0.1
    assert rejected.headers["retry-after"] == "30"  # nothing completed yet: the longest suggestion
    error = rejected.json()["error"]
    assert error["code"] == "overloaded" and "2 requests in flight" in error["message"]
    assert [r.status_code for r in done] == [200, 200] and after.status_code == 200
    assert ingress._gate.in_flight == 0


def test_a_request_that_fails_validation_takes_no_place():
    async def scenario():
        client, ingress = app_for(GatedEngine(), admission=LIMITS)
        async with client:
            bad = await client.post("/v1/completions", json={"model": MODEL["name"], "prompt": "hi", "max_tokens": -1})
        return bad, ingress

    bad, ingress = asyncio.run(scenario())
    assert bad.status_code == 400 and ingress._gate.in_flight == 0


def test_low_priority_is_refused_while_high_priority_still_gets_in():
    async def scenario():
        engine = GatedEngine()
        client, ingress = app_for(engine, admission={"max_running": 1, "max_queued": 2, "max_retry_s": 30})
        async with client:
            first = [asyncio.create_task(complete(client, **{"X-Priority": "low"})) for _ in range(2)]
            await _wait_until(lambda: engine.started == 2)
            low = await complete(client, **{"X-Priority": "low"})
            high = asyncio.create_task(complete(client, **{"X-Priority": "high"}))
            await _wait_until(lambda: engine.started == 3)
            unknown = await complete(client, **{"X-Priority": "urgent"})
            engine.open.set()
            results = await asyncio.gather(*first, high)
        return low, unknown, results

    low, unknown, results = asyncio.run(scenario())
    assert low.status_code == 429
    assert unknown.status_code == 400 and "known: high, low, normal" in unknown.json()["error"]["message"]
    assert [r.status_code for r in results] == [200, 200, 200]


def test_without_admission_limits_everything_is_admitted():
    async def scenario():
        engine = GatedEngine()
        client, ingress = app_for(engine)
        async with client:
            tasks = [asyncio.create_task(complete(client)) for _ in range(20)]
            await _wait_until(lambda: engine.started == 20)
            engine.open.set()
            return await asyncio.gather(*tasks)

    assert [r.status_code for r in asyncio.run(scenario())] == [200] * 20


def test_a_second_long_prompt_is_refused_while_short_ones_still_get_in():
    """The gate counts each request's prompt tokens (after rendering, the real tokenizer's):
    with room for 60 prompt tokens, one 40-token prompt in flight leaves no room for another,
    but a short one is admitted; the 429 names the token bound."""
    long_prompt = [7] * 40

    async def scenario():
        engine = GatedEngine()
        client, ingress = app_for(engine, admission={"max_running": 8, "max_queued": 8, "max_retry_s": 30,
                                                     "max_prompt_tokens": 60})
        async with client:
            first = asyncio.ensure_future(client.post("/v1/completions", json={
                "model": MODEL["name"], "prompt": long_prompt}))
            await _wait_until(lambda: engine.started == 1)
            refused = await client.post("/v1/completions", json={"model": MODEL["name"], "prompt": long_prompt})
            short = asyncio.ensure_future(complete(client))
            await _wait_until(lambda: engine.started == 2)
            engine.open.set()
            done = [await first, await short]
        return refused, done, ingress

    refused, done, ingress = asyncio.run(scenario())
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    assert "prompt tokens in flight" in refused.json()["error"]["message"]
    assert [r.status_code for r in done] == [200, 200]
    assert ingress._gate.in_flight == 0 and ingress._gate.prompt_tokens_in_flight == 0
