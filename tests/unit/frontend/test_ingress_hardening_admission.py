"""Admission places are held for the whole request and given back exactly once (issue 27): a
request of several sequences (n > 1, batch prompts) holds its place until its last sequence has
ended, however it ends; /tokenize and /detokenize take a place and tokenize off the event loop;
the places taken are exported as a gauge."""

import asyncio
import json
import os
import threading

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from deployments.frontend.openai_ingress import OpenAIIngress
from deployments.frontend.tokenizer import PromptTokenizer
from deployments.records import EngineFailure
from monitoring.exporter import MetricsExporter
from tests.unit.ingress_fakes import BLOCK, HELLO, HTTP, MODEL, FakeEngine, FakeMetricsBackend, front_end

LIMITS = {"max_running": 4, "max_queued": 0}
GAUGE = "moe_serve_ingress_admitted_requests"


class SplitEngine:
    """Child 0 of a request answers at once; every other child waits for `go`, then plays `tail`
    (TokenDeltas, an EngineFailure, an exception to raise, or BLOCK)."""

    def __init__(self, tail=HELLO):
        self.tail = list(tail)
        self.go = asyncio.Event()
        self.started: list[str] = []
        self.ended: list[str] = []

    async def stream(self, request, **_options):
        self.started.append(request.request_id)
        try:
            if request.request_id.endswith("-0"):
                for item in HELLO:
                    yield item
                return
            await self.go.wait()
            for item in self.tail:
                if item is BLOCK:
                    await asyncio.Event().wait()
                elif isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.ended.append(request.request_id)

    async def health(self, timeout_s):
        return None


def app_for(engine, backend=None, **options):
    exporter = MetricsExporter(backend=backend or FakeMetricsBackend())
    ingress = OpenAIIngress(engine, MODEL, HTTP, model_path="unused", front=front_end(), metrics=exporter, **options)

    async def endpoint(request):
        return await ingress(request)

    app = Starlette(routes=[Route("/{path:path}", endpoint, methods=["GET", "POST"])])
    return app, ingress


def async_client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress")


async def _wait_until(predicate):
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never became true")


TWO_SEQUENCES = {"n": {"model": "m", "prompt": "hi", "n": 2, "max_tokens": 3},
                 "batch": {"model": "m", "prompt": ["hi", "yo"], "max_tokens": 3}}


@pytest.mark.parametrize("stream", [False, True], ids=["collect", "sse"])
@pytest.mark.parametrize("shape", sorted(TWO_SEQUENCES))
@pytest.mark.parametrize("tail", [HELLO, [EngineFailure("replica died", retriable=True)], [RuntimeError("boom")]],
                         ids=["ok", "engine_failure", "exception"])
def test_the_place_is_held_until_the_last_sequence_ends_and_given_back_once(stream, shape, tail):
    async def scenario():
        engine, backend = SplitEngine(tail), FakeMetricsBackend()
        app, ingress = app_for(engine, backend, admission=LIMITS)
        sentinel = ingress._gate.admit(0.0)  # another request's place: a second give-back would free it
        assert sentinel is None
        async with async_client(app) as client:
            task = asyncio.create_task(client.post("/v1/completions", json={**TWO_SEQUENCES[shape], "stream": stream}))
            await _wait_until(lambda: len(engine.started) == 2 and len(engine.ended) == 1)
            await asyncio.sleep(0.05)  # whatever would give the place back early has run by now
            held, gauge_held = ingress._gate.in_flight, backend.values(GAUGE)[-1]
            engine.go.set()
            response = await task
        return held, gauge_held, response, ingress._gate.in_flight, backend.values(GAUGE), engine

    held, gauge_held, response, after, gauge, engine = asyncio.run(scenario())
    assert held == gauge_held == 2
    assert response.status_code in (200, 500, 503)
    assert after == gauge[-1] == 1 and len(engine.ended) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["collect", "sse"])
def test_a_failure_before_the_first_token_gives_the_place_back_once(stream):
    async def scenario():
        app, ingress = app_for(FakeEngine(script=[EngineFailure("replica died", retriable=True)]), admission=LIMITS)
        assert ingress._gate.admit(0.0) is None  # another request's place: a second give-back would free it
        async with async_client(app) as client:
            response = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": stream})
        return response, ingress._gate.in_flight

    response, in_flight = asyncio.run(scenario())
    assert response.status_code == 503 and in_flight == 1


def test_a_client_leaving_mid_stream_gives_the_place_back_once_when_both_sequences_are_stopped():
    engine = SplitEngine(tail=[BLOCK])
    app, ingress = app_for(engine, admission=LIMITS)
    body = json.dumps({"model": "m", "prompt": "hi", "n": 2, "stream": True, "max_tokens": 3}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}

    async def scenario():
        request_sent, in_flight_before_leaving = False, []
        engine.go.set()  # child 1 starts, then blocks for ever
        assert ingress._gate.admit(0.0) is None  # another request's place: a second give-back would free it

        async def receive():
            nonlocal request_sent
            if not request_sent:
                request_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await _wait_until(lambda: len(engine.ended) == 1)  # child 0 is done, child 1 still runs
            in_flight_before_leaving.append(ingress._gate.in_flight)
            return {"type": "http.disconnect"}

        async def send(message):
            pass

        await asyncio.wait_for(app(scope, receive, send), timeout=10)
        return in_flight_before_leaving

    assert asyncio.run(scenario()) == [2]
    assert ingress._gate.in_flight == 1
    assert sorted(engine.ended) == sorted(engine.started) and len(engine.started) == 2


# -- /tokenize and /detokenize --------------------------------------------------------------------


class BlockingTokenizer(PromptTokenizer):
    """The ingress's tokenizer, whose encode_prompt waits (in whatever thread runs it) until the
    test releases it, at most 5 s."""

    def __init__(self):
        super().__init__(front_end().tokenizer)
        self.entered, self.released = threading.Event(), threading.Event()
        self.released_in_time: bool | None = None

    def encode_prompt(self, prompt, add_special_tokens=True):
        self.entered.set()
        self.released_in_time = self.released.wait(timeout=5)
        return super().encode_prompt(prompt, add_special_tokens)


def test_tokenize_runs_off_the_event_loop_and_holds_an_admission_place():
    async def scenario():
        tok = BlockingTokenizer()
        app, ingress = app_for(FakeEngine(script=list(HELLO)), tokenizer=tok,
                               admission={"max_running": 1, "max_queued": 0})
        async with async_client(app) as client:
            tokenizing = asyncio.create_task(client.post("/tokenize", json={"prompt": "hi"}))
            await _wait_until(tok.entered.is_set)
            models = await client.get("/v1/models")  # the loop still serves while the tokenizer works
            refused = [await client.post("/tokenize", json={"prompt": "hi"}),
                       await client.post("/detokenize", json={"tokens": [1]}),
                       await client.post("/v1/completions", json={"model": "m", "prompt": "hi"})]
            tok.released.set()
            done = await tokenizing
        return tok, models, refused, done, ingress

    tok, models, refused, done, ingress = asyncio.run(scenario())
    assert tok.released_in_time and models.status_code == 200
    assert [r.status_code for r in refused] == [429, 429, 429]
    assert done.status_code == 200 and done.json()["tokens"]
    assert ingress._gate.in_flight == 0


def test_a_client_leaving_tokenize_leaves_the_place_taken_until_the_tokenizer_is_done():
    async def scenario():
        tok = BlockingTokenizer()
        app, ingress = app_for(FakeEngine(), tokenizer=tok, admission=LIMITS)
        async with async_client(app) as client:
            tokenizing = asyncio.create_task(client.post("/tokenize", json={"prompt": "hi"}))
            await _wait_until(tok.entered.is_set)
            tokenizing.cancel()
            await asyncio.gather(tokenizing, return_exceptions=True)
            while_working = ingress._gate.in_flight
            tok.released.set()
            await _wait_until(lambda: ingress._gate.in_flight == 0)
        return while_working

    assert asyncio.run(scenario()) == 1


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "hi", "bogus": 1}),
                                       ("/detokenize", {"tokens": [10 ** 9]}),
                                       ("/tokenize", {"model": "other", "prompt": "hi"})])
def test_a_refused_tokenizer_request_gives_its_place_back(path, body):
    async def scenario():
        app, ingress = app_for(FakeEngine(), admission=LIMITS)
        async with async_client(app) as client:
            response = await client.post(path, json=body)
        return response, ingress

    response, ingress = asyncio.run(scenario())
    assert 400 <= response.status_code < 500 and ingress._gate.in_flight == 0


def test_the_gauge_is_labelled_by_process_so_replicas_on_one_node_stay_apart():
    backend = FakeMetricsBackend()
    app_for(FakeEngine(), backend, admission=LIMITS)
    assert [(kind, tags) for kind, name, _, tags in backend.records if name == GAUGE] == \
        [("set", {"replica": str(os.getpid())})]  # 0 from the start: a scrape sees the series before traffic
