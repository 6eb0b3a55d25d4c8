"""The OpenAI ingress over HTTP (Starlette TestClient), with a fake engine and a fake tokenizer.

FakeEngine has HandleEngineClient's interface (stream() yields TokenDelta / EngineFailure,
health() raises when unhealthy) and FakeTokenizer has PromptTokenizer's, so the ingress runs
exactly the code it runs under Serve, minus Ray.
"""

import asyncio
import inspect
import json
from typing import Any
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from deployments import openai_responses as out
from deployments.engine_client import HandleEngineClient
from deployments.openai_ingress import HEALTH_TIMEOUT_S, OpenAIIngress
from deployments.records import EngineFailure, EngineRequest, SamplingSpec, TokenDelta
from deployments.tokenizer import PromptTokenizer

MAX_MODEL_LEN = 64
MODEL = {"name": "m", "path": "unused", "max_model_len": MAX_MODEL_LEN, "dtype": "bfloat16"}
HTTP = {"max_request_bytes": 4096}
BLOCK = object()  # in a script: wait forever (until cancelled)


class FakeTokenizer:
    """One token per character; chat adds one token per message boundary plus a generation prompt."""

    vocab_size = 200

    def encode_prompt(self, prompt: str) -> list[int]:
        return [ord(c) % 100 + 100 for c in prompt]

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        ids: list[int] = []
        for message in messages:
            ids += [1] + self.encode_prompt(message["role"] + ":" + message["content"])
        return ids + [2]


@dataclass
class StreamLog:
    """What happened to one stream the fake engine served."""

    request: EngineRequest
    yielded: int = 0  # items handed to the consumer
    exhausted: bool = False
    closed_early: bool = False  # GeneratorExit: the consumer called aclose()
    cancelled: bool = False
    finalized: bool = False


@dataclass
class FakeEngine:
    """A script of items per request: TokenDelta, EngineFailure, an Exception to raise, or BLOCK."""

    script: list = field(default_factory=list)
    health_error: Exception | None = None
    streams: list[StreamLog] = field(default_factory=list)
    health_timeouts: list[float] = field(default_factory=list)

    async def stream(self, request: EngineRequest, **_options: Any) -> AsyncIterator[TokenDelta | EngineFailure]:
        log = StreamLog(request)
        self.streams.append(log)
        try:
            for item in self.script:
                if item is BLOCK:
                    await asyncio.Event().wait()
                elif isinstance(item, Exception):
                    raise item
                else:
                    log.yielded += 1
                    yield item
            log.exhausted = True
        except GeneratorExit:
            log.closed_early = True
            raise
        except asyncio.CancelledError:
            log.cancelled = True
            raise
        finally:
            log.finalized = True

    async def health(self, timeout_s: float) -> None:
        self.health_timeouts.append(timeout_s)
        if self.health_error is not None:
            raise self.health_error


def test_fakes_have_the_real_interfaces():
    def params(fn):
        return list(inspect.signature(fn).parameters)

    assert inspect.isasyncgenfunction(HandleEngineClient.stream) and inspect.isasyncgenfunction(FakeEngine.stream)
    assert inspect.iscoroutinefunction(HandleEngineClient.health) and inspect.iscoroutinefunction(FakeEngine.health)
    assert params(FakeEngine.stream) == params(HandleEngineClient.stream)
    assert params(FakeEngine.health) == params(HandleEngineClient.health)
    for name in ("encode_prompt", "encode_chat"):
        assert params(getattr(FakeTokenizer, name)) == params(getattr(PromptTokenizer, name))
    assert "vocab_size" in vars(FakeTokenizer)  # PromptTokenizer sets it per instance


def deltas(*texts: str, finish: str = "stop", prompt_tokens: int = 0) -> list[TokenDelta]:
    """One delta per text, one token id per delta (id 10, 11, ...), the last one finishing."""
    items = []
    for i, text in enumerate(texts):
        items.append(TokenDelta(text, [10 + i], finish if i == len(texts) - 1 else None, prompt_tokens, i + 1))
    return items


HELLO = deltas("Hello", " big", " world", finish="length")


def make_client(engine: FakeEngine) -> tuple[TestClient, OpenAIIngress]:
    ingress = OpenAIIngress(engine, MODEL, HTTP, model_path="unused", tokenizer=FakeTokenizer())

    async def endpoint(request):
        return await ingress(request)

    app = Starlette(routes=[Route("/{path:path}", endpoint, methods=["GET", "POST", "PUT", "DELETE"])])
    return TestClient(app), ingress


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(script=list(HELLO))


@pytest.fixture
def client(engine) -> TestClient:
    with make_client(engine)[0] as c:
        yield c


def sse_events(text: str) -> list:
    """Decode an SSE body into JSON payloads, with "[DONE]" kept as the string."""
    assert text.endswith("\n\n")
    events = []
    for block in text.strip("\n").split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response, status: int, code: str | None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    assert error["message"]
    return error


# -- models and health ------------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    response = client.get("/v1/models")
    assert response.status_code == 200
    (model,) = response.json()["data"]
    assert (model["id"], model["object"], model["max_model_len"]) == ("m", "model", MAX_MODEL_LEN)


def test_health_ok(client, engine):
    response = client.get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})
    assert engine.health_timeouts == [HEALTH_TIMEOUT_S]


def test_health_503_when_the_engine_is_unhealthy(client, engine):
    engine.health_error = TimeoutError("engine pool did not answer")
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json() == {"status": "unhealthy", "reason": "TimeoutError: engine pool did not answer"}


# -- non-streaming --------------------------------------------------------------------------


def test_completion(client, engine):
    response = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "max_tokens": 3})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "m"
    assert body["id"].startswith("cmpl-") and response.headers["x-request-id"] == body["id"]
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("Hello big world", "length")
    assert "token_ids" not in choice and "prompt_token_ids" not in body
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    (stream,) = engine.streams
    assert stream.request.request_id == body["id"]
    assert stream.request.prompt_token_ids == FakeTokenizer().encode_prompt("hey")
    assert stream.exhausted


def test_completion_returns_token_ids_on_request(client):
    body = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "return_token_ids": True}).json()
    assert body["choices"][0]["token_ids"] == [10, 11, 12]
    assert body["prompt_token_ids"] == FakeTokenizer().encode_prompt("hey")


def test_completion_with_token_id_prompt(client, engine):
    body = client.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7, 8]}).json()
    assert body["usage"]["prompt_tokens"] == 4
    assert engine.streams[0].request.prompt_token_ids == [5, 6, 7, 8]


def test_token_id_outside_vocabulary(client, engine):
    response = client.post("/v1/completions", json={"model": "m", "prompt": [5, FakeTokenizer.vocab_size]})
    error = assert_error(response, 400, None, param="prompt")
    assert str(FakeTokenizer.vocab_size) in error["message"]
    assert engine.streams == []


def test_chat_completion(client, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Hello big world"}
    assert engine.streams[0].request.prompt_token_ids == FakeTokenizer().encode_chat(messages)


def test_chat_text_parts_are_joined_before_tokenizing(client, engine):
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": parts}]})
    assert engine.streams[0].request.prompt_token_ids == FakeTokenizer().encode_chat([{"role": "user", "content": "hi"}])


# -- sampling settings handed to the engine ---------------------------------------------------


def test_sampling_spec_of_a_completion(client, engine):
    client.post("/v1/completions", json={
        "model": "m", "prompt": "hey", "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 7,
        "stop": ["\n", "END"], "min_tokens": 2, "repetition_penalty": 1.1})
    sampling = engine.streams[0].request.sampling
    assert sampling == SamplingSpec(max_tokens=16, temperature=0.0, top_p=0.5, top_k=0, min_tokens=2, seed=7,
                                    stop=("\n", "END"), repetition_penalty=1.1)
    assert isinstance(sampling.temperature, float)


def test_completion_max_tokens_defaults_to_16(client, engine):
    client.post("/v1/completions", json={"model": "m", "prompt": "hey"})
    assert engine.streams[0].request.sampling.max_tokens == 16


def test_chat_without_max_tokens_gets_the_remaining_context(client, engine):
    messages = [{"role": "user", "content": "hi"}]
    client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "stop": "x"})
    sampling = engine.streams[0].request.sampling
    assert sampling.max_tokens == MAX_MODEL_LEN - len(FakeTokenizer().encode_chat(messages))
    assert sampling.stop == ("x",)
    assert sampling.temperature == 1.0


def test_chat_max_completion_tokens(client, engine):
    client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "max_completion_tokens": 5})
    assert engine.streams[0].request.sampling.max_tokens == 5


# -- request errors ---------------------------------------------------------------------------


def test_prompt_as_long_as_the_context(client, engine):
    response = client.post("/v1/completions", json={"model": "m", "prompt": "a" * MAX_MODEL_LEN, "max_tokens": 1})
    error = assert_error(response, 400, "context_length_exceeded", param="prompt")
    assert f"{MAX_MODEL_LEN} tokens" in error["message"]
    assert engine.streams == []


def test_prompt_plus_max_tokens_over_the_context(client, engine):
    response = client.post("/v1/completions", json={"model": "m", "prompt": "a" * 60, "max_tokens": 5})
    error = assert_error(response, 400, "context_length_exceeded", param="max_tokens")
    assert "at most 4" in error["message"]
    assert engine.streams == []


def test_prompt_plus_max_tokens_exactly_the_context_is_fine(client, engine):
    response = client.post("/v1/completions", json={"model": "m", "prompt": "a" * 60, "max_tokens": 4})
    assert response.status_code == 200
    assert engine.streams[0].request.sampling.max_tokens == 4


def test_chat_over_the_context(client):
    response = client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "a" * MAX_MODEL_LEN}]})
    assert_error(response, 400, "context_length_exceeded", param="prompt")


def test_unknown_model(client, engine):
    response = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hey"})
    error = assert_error(response, 404, "model_not_found")
    assert "gpt-9" in error["message"] and "'m'" in error["message"]
    assert engine.streams == []


def test_validation_error_reaches_the_client(client):
    response = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "max_tokens": "5"})
    assert_error(response, 400, "invalid_value", param="max_tokens")


def test_malformed_json(client):
    response = client.post("/v1/completions", content=b'{"model": "m", "prompt": ',
                           headers={"content-type": "application/json"})
    assert_error(response, 400, "invalid_json")


def test_body_not_an_object(client):
    assert_error(client.post("/v1/completions", json=["m"]), 400, "invalid_body")


def test_body_over_the_limit(client, engine):
    response = client.post("/v1/completions", json={"model": "m", "prompt": "a" * HTTP["max_request_bytes"]})
    error = assert_error(response, 413, "body_too_large")
    assert str(HTTP["max_request_bytes"]) in error["message"]
    assert engine.streams == []


def test_body_over_the_limit_without_content_length(client):
    # A chunked upload declares no length; the ingress still counts the bytes.
    body = json.dumps({"model": "m", "prompt": "a" * HTTP["max_request_bytes"]}).encode()
    response = client.post("/v1/completions", content=iter([body[:100], body[100:]]),
                           headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_error(response, 413, "body_too_large")


def test_wrong_method_on_a_known_route(client):
    assert_error(client.get("/v1/completions"), 405, "method_not_allowed")
    assert_error(client.post("/v1/models"), 405, "method_not_allowed")


def test_unknown_path(client):
    error = assert_error(client.get("/v2/anything"), 404, "not_found")
    assert "/v1/completions" in error["message"]


def test_trailing_slash_is_tolerated(client):
    assert client.get("/v1/models/").status_code == 200


# -- streaming --------------------------------------------------------------------------------


def test_streaming_completion(client, engine):
    response = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hello", " big", " world"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "length"]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert {c["id"] for c in chunks} == {response.headers["x-request-id"]}
    assert all("usage" not in c for c in chunks)
    assert engine.streams[0].exhausted


def test_streaming_chat_first_delta_has_the_role(client):
    response = client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    chunks = sse_events(response.text)[:-1]
    deltas_ = [c["choices"][0]["delta"] for c in chunks]
    assert deltas_ == [{"role": "assistant", "content": "Hello"}, {"content": " big"}, {"content": " world"}]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_streaming_chat_sends_the_role_even_if_the_first_delta_is_empty():
    engine = FakeEngine(script=[TokenDelta("", [], None, 0, 0), *deltas("A")])
    with make_client(engine)[0] as client:
        response = client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    chunks = sse_events(response.text)[:-1]
    assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {"content": "A"}]


def test_streaming_include_usage(client):
    response = client.post("/v1/completions", json={
        "model": "m", "prompt": "hey", "stream": True, "stream_options": {"include_usage": True},
        "return_token_ids": True})
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert [c["choices"][0]["token_ids"] for c in events[:-2]] == [[10], [11], [12]]


def test_stream_that_yields_nothing_still_ends_with_done():
    engine = FakeEngine(script=[])
    with make_client(engine)[0] as client:
        response = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "stream": True})
    assert sse_events(response.text) == ["[DONE]"]


# -- engine failures --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_engine_failure_first_is_a_503_json_error(stream):
    engine = FakeEngine(script=[EngineFailure("replica is draining", retriable=True), *HELLO])
    with make_client(engine)[0] as client:
        response = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "stream": stream})
    error = assert_error(response, 503, "retry")
    assert error["message"] == "replica is draining"
    assert response.headers["content-type"].startswith("application/json")
    log = engine.streams[0]
    assert log.yielded == 1 and not log.exhausted  # only the failure was read


def test_non_retriable_engine_failure_is_a_500():
    engine = FakeEngine(script=[EngineFailure("engine error: boom", retriable=False)])
    with make_client(engine)[0] as client:
        response = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "stream": True})
    error = assert_error(response, 500, None)
    assert error["type"] == "internal_error"


def test_engine_failure_mid_stream_is_an_sse_error_then_done():
    engine = FakeEngine(script=[*deltas("Hel", "lo", finish=None)[:1], EngineFailure("replica died", retriable=True),
                                *HELLO])
    with make_client(engine)[0] as client:
        response = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "stream": True})
    assert response.status_code == 200  # headers went out with the first token
    events = sse_events(response.text)
    assert events[0]["choices"][0]["text"] == "Hel"
    assert events[1] == {"error": {"message": "replica died", "type": "service_unavailable", "param": None,
                                   "code": "retry"}}
    assert events[2:] == ["[DONE]"]
    log = engine.streams[0]
    assert log.yielded == 2 and not log.exhausted  # nothing after the failure was read


def test_engine_failure_mid_collect_is_an_error():
    engine = FakeEngine(script=[*deltas("Hel", finish=None), EngineFailure("replica died", retriable=True)])
    with make_client(engine)[0] as client:
        response = client.post("/v1/completions", json={"model": "m", "prompt": "hey"})
    assert_error(response, 503, "retry")


@pytest.mark.parametrize("stream", [False, True])
def test_exception_in_the_engine_is_a_500_and_the_next_request_works(stream):
    engine = FakeEngine(script=[RuntimeError("bug in the engine client")])
    with make_client(engine)[0] as client:
        response = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "stream": stream})
        error = assert_error(response, 500, None)
        assert error["message"] == "internal error"  # no internals leak to the client
        engine.script = list(HELLO)
        again = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "stream": stream})
    assert again.status_code == 200
    assert "Hello" in again.text


def test_exception_mid_stream_is_an_sse_error_then_done():
    engine = FakeEngine(script=[*deltas("Hel", finish=None), RuntimeError("replica connection lost")])
    with make_client(engine)[0] as client:
        response = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "stream": True})
        events = sse_events(response.text)
        assert events[0]["choices"][0]["text"] == "Hel"
        assert events[1]["error"]["type"] == "internal_error"
        assert events[1]["error"]["message"] == "internal error"
        assert events[2:] == ["[DONE]"]
        engine.script = list(HELLO)
        assert client.post("/v1/completions", json={"model": "m", "prompt": "hey"}).status_code == 200


# -- client disconnects -----------------------------------------------------------------------


def test_closing_the_sse_body_closes_the_engine_stream():
    """When the server stops the SSE body (client gone), the engine stream must be closed at once,
    which for HandleEngineClient cancels the remote call and aborts the request in the engine."""
    engine = FakeEngine(script=deltas("a", "b", "c", "d"))
    _, ingress = make_client(engine)
    ctx = out.ResponseContext(request_id="cmpl-x", model="m", chat=False, prompt_token_ids=[1])

    async def scenario():
        stream = engine.stream(EngineRequest("cmpl-x", [1], SamplingSpec(max_tokens=4)))
        first = await anext(stream)
        body = ingress._sse(ctx, first, stream)
        assert b'"text":"a"' in await anext(body)
        assert b'"text":"b"' in await anext(body)
        await body.aclose()
        # The test still holds `stream`, so only the ingress can have closed it.
        return engine.streams[0]

    log = asyncio.run(scenario())
    assert log.closed_early and log.finalized and not log.exhausted
    assert log.yielded == 2


def test_client_disconnect_mid_stream_stops_the_engine_stream():
    """Drive the ASGI app by hand: the client disconnects after the first chunk while the engine
    is still generating; the request must end (not hang) and the engine stream must be cancelled."""
    engine = FakeEngine(script=[*deltas("first", finish=None), BLOCK, *HELLO])
    ingress = OpenAIIngress(engine, MODEL, HTTP, model_path="unused", tokenizer=FakeTokenizer())

    async def endpoint(request):
        return await ingress(request)

    app = Starlette(routes=[Route("/{path:path}", endpoint, methods=["POST"])])
    body = json.dumps({"model": "m", "prompt": "hey", "stream": True}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }
    chunks: list[bytes] = []

    async def scenario():
        got_chunk = asyncio.Event()
        request_sent = False

        async def receive():
            nonlocal request_sent
            if not request_sent:
                request_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await got_chunk.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                got_chunk.set()

        await asyncio.wait_for(app(scope, receive, send), timeout=5)

    asyncio.run(scenario())
    assert len(chunks) == 1 and b'"text":"first"' in chunks[0]
    log = engine.streams[0]
    assert log.cancelled and log.finalized and not log.exhausted
