"""Bounded waits in the request path (manifest request_timeouts), through the real ingress.

Engines hang before their first token, between tokens or in the prefill; each request must be
answered within its bound (504 in OpenAI's shape, or an SSE error event then [DONE] once
tokens were streamed), aborted in the engine, never leave a prefill lease behind, and other
requests must keep being served. Two levels of fakes, both behind the real interfaces:
FakeEngine (HandleEngineClient's) for the ingress's own logic, and the real LLMServer on a
fake vLLM engine behind a fake Serve handle (cancelling a streamed call cancels the replica's
generator, as Serve does), to see the abort reach the engine.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from deployments.engine_client import HandleEngineClient
from deployments.engine.llm_server import LLMServer
from deployments.frontend.openai_ingress import OpenAIIngress
from deployments.records import EngineRequest, PrefillResult, SamplingSpec, TokenDelta, WaitExpired
from monitoring.exporter import MetricsExporter
from tests.unit.ingress_fakes import BLOCK, HELLO, HTTP, MODEL, FakeEngine, FakeMetricsBackend, deltas, front_end

TIMEOUTS = {"prefill_timeout_s": 0.4, "first_token_timeout_s": 0.8, "inter_token_timeout_s": 0.4}
SLACK_S = 2.0  # a loaded CI box: answered within bound + this, never after the guard
GUARD_S = 15.0  # without the bounds these requests would never be answered
HANG = object()  # in a ScriptedVLLMEngine script: wait until the request is aborted
LEASE = {"remote_host": "127.0.0.1", "remote_port": 9, "remote_engine_id": "e", "remote_request_id": "cmpl-p-0",
         "remote_block_ids": [0], "remote_num_tokens": 3, "block_size_tokens": 16, "lease_deadline_unix_s": 4e9,
         "do_remote_prefill": True}


# -- fakes --------------------------------------------------------------------------------------


class ScriptedVLLMEngine:
    """VLLMEngine's interface. At HANG a request waits until aborted, then ends as vLLM ends an
    aborted request (a final "abort" delta), or with `on_abort` (a prompt that finished first)."""

    max_model_len = 2048

    def __init__(self, script: list, on_abort: TokenDelta | None = None):
        self.script, self.on_abort = script, on_abort
        self.requests: list[EngineRequest] = []
        self.aborted: list[str] = []
        self._abort_events: dict[str, asyncio.Event] = {}

    async def generate(self, request: EngineRequest):
        self.requests.append(request)
        aborted = self._abort_events.setdefault(request.request_id, asyncio.Event())
        for item in self.script:
            if item is HANG:
                await aborted.wait()
                yield self.on_abort or TokenDelta("", [], "abort", len(request.prompt_token_ids), 0)
                return
            yield item

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._abort_events.setdefault(request_id, asyncio.Event()).set()

    def unfinished_requests(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass


class RecordingKVClient:
    def __init__(self):
        self.released: list[str] = []

    def release(self, host, port, request_id, timeout_s, block_ids=(), grant=b""):
        self.released.append(request_id)


class FakeStreamingResponse:
    """A streamed Serve call: the replica's generator runs in its own task; cancel() cancels it."""

    def __init__(self, items):
        self.cancelled = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._pump(items))

    async def _pump(self, items) -> None:
        try:
            async for item in items:
                await self._queue.put(("item", item))
            await self._queue.put(("end", None))
        except Exception as exc:
            await self._queue.put(("error", exc))

    def __aiter__(self):
        return self

    async def __anext__(self):
        kind, value = await self._queue.get()
        if kind == "end":
            raise StopAsyncIteration
        if kind == "error":
            raise value
        return value

    def cancel(self) -> None:
        self.cancelled = True
        self._task.cancel()


class FakeServeHandle:
    """A DeploymentHandle's interface over a plain server object, called the way Serve calls it."""

    def __init__(self, server: Any, stream: bool = False, responses: list | None = None):
        self._server, self._stream = server, stream
        self.responses = [] if responses is None else responses

    def options(self, stream: bool = False, **_: Any) -> "FakeServeHandle":
        return FakeServeHandle(self._server, stream, self.responses)

    def __getattr__(self, name: str):
        method, handle = getattr(self._server, name), self

        class _Method:
            @staticmethod
            def remote(*args):
                if handle._stream:
                    response = FakeStreamingResponse(method(*args))
                    handle.responses.append(response)
                    return response
                return method(*args)

        return _Method()


def make_server(engine: ScriptedVLLMEngine, kv: bool = False, timeouts: dict = TIMEOUTS) -> LLMServer:
    kv_transfer = {"backend": "tcp", "host": "127.0.0.1", "lease_s": 30, "transfer_timeout_s": 0.1,
                   "failure_policy": "recompute"} if kv else None
    server = LLMServer({"name": "m", "max_model_len": 2048}, {"stream_interval_ms": 0}, "/ckpt", kv_transfer,
                       engine_factory=lambda *a, **k: engine, metrics=False, request_timeouts=timeouts)
    if kv:
        server._kv_client = RecordingKVClient()
    return server


def make_app(engine: Any, backend: FakeMetricsBackend | None = None, timeouts: dict = TIMEOUTS,
             **options: Any) -> Starlette:
    ingress = OpenAIIngress(engine, MODEL, HTTP, model_path="unused", front=front_end(), request_timeouts=timeouts,
                            metrics=MetricsExporter(backend=backend or FakeMetricsBackend()), **options)

    async def endpoint(request):
        return await ingress(request)

    return Starlette(routes=[Route("/{path:path}", endpoint, methods=["GET", "POST"])])


async def post(app: Starlette, stream: bool = False, prompt: str = "hey") -> tuple[httpx.Response, float]:
    started = time.monotonic()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://ingress") as client:
        response = await asyncio.wait_for(client.post("/v1/completions", json={
            "model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream}), GUARD_S)
    return response, time.monotonic() - started


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, GUARD_S * 2))


def assert_timeout(response: httpx.Response, wait: str, elapsed_s: float, bound_s: float) -> dict:
    assert response.status_code == 504, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "timeout_error" and error["code"] == f"{wait}_timeout"
    assert f"request_timeouts.{wait}_timeout_s" in error["message"]  # names the field to raise
    assert bound_s * 0.9 <= elapsed_s < bound_s + SLACK_S, elapsed_s
    return error


def sse_events(text: str) -> list:
    import json

    return [b[6:] if b[6:] == "[DONE]" else json.loads(b[6:]) for b in text.strip("\n").split("\n\n")]


# -- the ingress's own bounds (FakeEngine behind HandleEngineClient's interface) ---------------


@pytest.mark.parametrize("stream", [False, True])
def test_no_first_token_is_a_504_naming_the_wait_and_the_engine_stream_is_cancelled(stream):
    engine, backend = FakeEngine(script=[BLOCK]), FakeMetricsBackend()
    response, elapsed_s = run(post(make_app(engine, backend), stream=stream))
    assert_timeout(response, "first_token", elapsed_s, TIMEOUTS["first_token_timeout_s"])
    log = engine.streams[0]
    assert log.cancelled and log.finalized  # for a Serve handle: the remote call is cancelled
    assert backend.values("moe_serve_requests", outcome="timeout") == [1.0]
    assert backend.values("moe_serve_request_timeouts", route="completions", wait="first_token") == [1.0]


def test_a_stream_stalled_between_tokens_ends_with_an_error_event_then_done():
    engine, backend = FakeEngine(script=[*deltas("Hel", finish=None), BLOCK, *HELLO]), FakeMetricsBackend()
    response, elapsed_s = run(post(make_app(engine, backend), stream=True))
    assert response.status_code == 200  # headers went out with the first token
    events = sse_events(response.text)
    assert events[0]["choices"][0]["text"] == "Hel"
    error = events[1]["error"]
    assert error["code"] == "inter_token_timeout" and error["type"] == "timeout_error"
    assert "request_timeouts.inter_token_timeout_s" in error["message"]
    assert events[2:] == ["[DONE]"]
    assert elapsed_s < TIMEOUTS["inter_token_timeout_s"] + SLACK_S
    assert engine.streams[0].cancelled
    assert backend.values("moe_serve_request_timeouts", wait="inter_token") == [1.0]
    assert backend.values("moe_serve_requests", outcome="timeout") == [1.0]


def test_a_non_streaming_request_stalled_between_tokens_is_a_504():
    engine = FakeEngine(script=[*deltas("Hel", finish=None), BLOCK])
    response, elapsed_s = run(post(make_app(engine)))
    assert_timeout(response, "inter_token", elapsed_s, TIMEOUTS["inter_token_timeout_s"])
    assert engine.streams[0].cancelled


def test_the_total_bound_ends_a_stream_that_keeps_trickling():
    class Trickle(FakeEngine):
        async def stream(self, request, **_):
            self.streams.append(request)
            for i in range(1000):  # a token every 0.1 s: never an inter-token timeout
                await asyncio.sleep(0.1)
                yield TokenDelta("x", [10], None, 3, i + 1)

    response, elapsed_s = run(post(make_app(Trickle(), timeouts={**TIMEOUTS, "total_timeout_s": 1.2})))
    assert_timeout(response, "total", elapsed_s, 1.2)


def test_other_requests_are_served_while_one_hangs():
    class HangsFirst(FakeEngine):
        async def stream(self, request, **options):
            script = [BLOCK] if not self.streams else list(HELLO)
            self.script = script
            async for item in super().stream(request, **options):
                yield item

    engine = HangsFirst()
    app = make_app(engine)

    async def scenario():
        stuck = asyncio.ensure_future(post(app))
        await asyncio.sleep(0.1)
        served, served_s = await post(app)
        assert not stuck.done()  # answered while the other request still waits
        return served, served_s, await stuck

    served, served_s, (stuck, stuck_s) = run(scenario())
    assert served.status_code == 200 and served.json()["choices"][0]["text"] == "Hello big world"
    assert served_s < TIMEOUTS["first_token_timeout_s"]
    assert_timeout(stuck, "first_token", stuck_s, TIMEOUTS["first_token_timeout_s"])


# -- down to the engine: the real LLMServer on a fake vLLM engine, behind fake Serve handles ----


def test_a_colocated_stream_stalled_between_tokens_is_aborted_in_the_engine():
    engine = ScriptedVLLMEngine([TokenDelta("a", [10], None, 3, 1), HANG])
    handle = FakeServeHandle(make_server(engine))
    response, elapsed_s = run(post(make_app(HandleEngineClient(handle)), stream=True))
    events = sse_events(response.text)
    assert events[1]["error"]["code"] == "inter_token_timeout" and events[2:] == ["[DONE]"]
    assert handle.responses[0].cancelled
    assert engine.aborted == [engine.requests[0].request_id]


def test_a_hung_prefill_is_a_504_aborted_in_the_prefill_engine_and_decode_is_never_asked():
    prefill_engine, decode_engine = ScriptedVLLMEngine([HANG]), ScriptedVLLMEngine(list(HELLO))
    prefill_server = make_server(prefill_engine, kv=True)
    app = make_app(FakeServeHandle(make_server(decode_engine)), prefill=FakeServeHandle(prefill_server))

    async def scenario():
        response, elapsed_s = await post(app)
        for _ in range(200):  # the prefill replica aborts at its own bound, from its receipt
            if prefill_engine.aborted:
                break
            await asyncio.sleep(0.01)
        return response, elapsed_s

    response, elapsed_s = run(scenario())
    assert_timeout(response, "prefill", elapsed_s, TIMEOUTS["prefill_timeout_s"])
    assert prefill_engine.aborted == [prefill_engine.requests[0].request_id]
    assert decode_engine.requests == []
    assert prefill_server._kv_client.released == []  # an aborted prompt holds no lease


def test_a_prefill_that_finishes_as_it_is_aborted_has_its_lease_released():
    """The prompt finished (lease granted) just as the bound expired: the lease is not lost."""
    finished = TokenDelta("x", [5], "length", 3, 1, kv_transfer_params=LEASE)
    prefill_engine = ScriptedVLLMEngine([HANG], on_abort=finished)
    prefill_server = make_server(prefill_engine, kv=True)
    decode_engine = ScriptedVLLMEngine(list(HELLO))
    app = make_app(FakeServeHandle(make_server(decode_engine)), prefill=FakeServeHandle(prefill_server))

    async def scenario():
        response, elapsed_s = await post(app)
        for _ in range(200):
            if prefill_server._kv_client.released:
                break
            await asyncio.sleep(0.01)
        return response, elapsed_s

    response, elapsed_s = run(scenario())
    assert_timeout(response, "prefill", elapsed_s, TIMEOUTS["prefill_timeout_s"])
    assert prefill_server._kv_client.released == ["cmpl-p-0"]
    assert decode_engine.requests == []


def test_an_unresponsive_prefill_replica_is_a_504_and_a_lease_it_returns_later_is_released():
    """The replica itself is stuck (its own bound cannot fire): the ingress's bound answers."""
    gate = asyncio.Event()

    class StuckReplica:
        def __init__(self):
            self.released: list[dict] = []

        async def prefill(self, request):
            await gate.wait()
            return PrefillResult(LEASE, 3, 0.01)

        async def release(self, params):
            self.released.append(params)

    replica, decode_engine = StuckReplica(), ScriptedVLLMEngine(list(HELLO))
    app = make_app(FakeServeHandle(make_server(decode_engine)), prefill=FakeServeHandle(replica))

    async def scenario():
        response, elapsed_s = await post(app)
        gate.set()  # the replica answers after all, with a lease nobody waits for
        for _ in range(200):
            if replica.released:
                break
            await asyncio.sleep(0.01)
        return response, elapsed_s

    response, elapsed_s = run(scenario())
    assert_timeout(response, "prefill", elapsed_s, TIMEOUTS["prefill_timeout_s"])
    assert [p["remote_request_id"] for p in replica.released] == ["cmpl-p-0"]
    assert decode_engine.requests == []


def test_decode_without_a_first_token_is_a_504_aborted_in_decode_and_the_lease_is_released():
    prefill_engine = ScriptedVLLMEngine([TokenDelta("x", [5], "length", 3, 1, kv_transfer_params=LEASE)])
    prefill_server = make_server(prefill_engine, kv=True)
    decode_engine = ScriptedVLLMEngine([HANG])
    decode = FakeServeHandle(make_server(decode_engine))
    app = make_app(decode, prefill=FakeServeHandle(prefill_server))

    async def scenario():
        response, elapsed_s = await post(app)
        for _ in range(200):
            if prefill_server._kv_client.released:
                break
            await asyncio.sleep(0.01)
        return response, elapsed_s

    response, elapsed_s = run(scenario())
    assert_timeout(response, "first_token", elapsed_s, TIMEOUTS["first_token_timeout_s"])
    assert decode.responses[0].cancelled
    assert decode_engine.aborted == [decode_engine.requests[0].request_id]
    assert prefill_server._kv_client.released == ["cmpl-p-0"]  # decode never pulled: the ingress frees it


def test_the_prefill_server_bounds_its_own_prefill_and_aborts_it():
    engine = ScriptedVLLMEngine([HANG])
    server = make_server(engine, kv=True)

    async def scenario():
        started = time.monotonic()
        result = await server.prefill(EngineRequest("r-1", [1, 2, 3], SamplingSpec(max_tokens=4)))
        return result, time.monotonic() - started

    result, elapsed_s = run(scenario())
    assert isinstance(result, WaitExpired) and result.wait == "prefill"
    assert "request_timeouts.prefill_timeout_s" in result.message
    assert elapsed_s < TIMEOUTS["prefill_timeout_s"] + SLACK_S
    assert engine.aborted == ["r-1"]


def test_a_long_prompts_prefill_gets_its_bound_grown_by_its_length():
    """0.4 s plus 0.5 s per thousand prompt tokens: a 2,000-token prompt is aborted at 1.4 s, not
    at the short prompts' 0.4 s, and the 504 names the bound that applied."""
    engine = ScriptedVLLMEngine([HANG])
    server = make_server(engine, kv=True, timeouts={**TIMEOUTS, "prefill_s_per_1k_tokens": 0.5})

    async def scenario():
        started = time.monotonic()
        result = await server.prefill(EngineRequest("r-long", list(range(2000)), SamplingSpec(max_tokens=4)))
        return result, time.monotonic() - started

    result, elapsed_s = run(scenario())
    assert isinstance(result, WaitExpired) and result.limit_s == pytest.approx(1.4)
    assert 1.4 <= elapsed_s < 1.4 + SLACK_S
    assert engine.aborted == ["r-long"]


def test_a_prefill_within_its_bound_hands_over_the_lease_time_left():
    deadline = time.time() + 30
    lease = {**LEASE, "lease_deadline_unix_s": deadline, "lease_remaining_s": 30.0}
    server = make_server(ScriptedVLLMEngine([TokenDelta("x", [5], "length", 3, 1, kv_transfer_params=lease)]), kv=True)
    result = run(server.prefill(EngineRequest("r-1", [1, 2, 3], SamplingSpec(max_tokens=4))))
    assert isinstance(result, PrefillResult)
    # Read off the deadline with this node's clock as the params leave: never more than issued.
    assert 29.0 < result.transfer_params.lease_remaining_s <= 30.0
