"""The OpenAI ingress over HTTP: streaming, engine failures and client disconnects."""

import asyncio
import json

import pytest

from deployments.frontend.responses import ResponseContext
from deployments.frontend.openai_ingress import OpenAIIngress, _merged
from deployments.records import EngineFailure, EngineRequest, TokenDelta
from starlette.applications import Starlette
from starlette.routing import Route

from tests.unit.ingress_fakes import (BLOCK, HELLO, HTTP, MODEL, FakeEngine, assert_error, deltas, front_end,
                                      make_client, sse_events, tokenizer)
from tests.unit.ingress_fakes import client, engine  # noqa: F401 (fixtures, named for linters)

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
    prompt_tokens = len(tokenizer().encode_prompt("hey"))
    assert usage_chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 3,
                                    "total_tokens": prompt_tokens + 3}
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
    assert "replica" not in error["message"] and "retry" in error["message"]  # the engine's own text stays in logs
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
    assert events[1] == {"error": {"message": "the engine pool could not serve this request now; retry",
                                   "type": "service_unavailable", "param": None, "code": "retry"}}
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

    async def scenario():
        rendered = await front_end().render(False, {"model": "m", "prompt": [1], "max_tokens": 4, "stream": True})
        ctx = ResponseContext(rendered, "m")
        (child,) = rendered.children
        merged = _merged(rendered.children, [engine.stream(EngineRequest("cmpl-x", [1], child.sampling))])
        first = await anext(merged)
        body = ingress._sse(ctx, first, merged, ingress._metrics.start("completions"))
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
    ingress = OpenAIIngress(engine, MODEL, HTTP, model_path="unused", front=front_end())

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


def test_streamed_logprobs_are_resolved_by_vllms_derender():
    def entry(token_id):
        return (token_id, -0.5, 1, [(token_id, -0.5, 1), (token_id + 1, -1.25, 2)])

    script = [TokenDelta("a", [40], None, 3, 1, logprobs=[entry(40)]),
              TokenDelta("b", [41], "length", 3, 2, logprobs=[entry(41)])]
    with make_client(FakeEngine(script=script))[0] as client:
        response = client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "logprobs": True,
            "top_logprobs": 2})
    chunks = [e for e in sse_events(response.text) if e != "[DONE]"]
    content = [c["choices"][0]["logprobs"]["content"][0] for c in chunks]
    assert [c["logprob"] for c in content] == [-0.5, -0.5]
    assert [c["token"] for c in content] == [tokenizer().decode([40]), tokenizer().decode([41])]
    assert [[t["logprob"] for t in c["top_logprobs"]] for c in content] == [[-0.5, -1.25]] * 2
    assert [c["choices"][0]["delta"].get("content") for c in chunks] == ["a", "b"]
