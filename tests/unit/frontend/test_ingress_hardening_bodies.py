"""No request body gets a 5xx (issue 27), on the real ingress and vLLM's real render layer:
lone surrogates anywhere, the types vLLM's validators assume, bodies past the size limit
without a Content-Length, /tokenize and /detokenize past the context, and an unexpected error."""

import asyncio
import json

import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from deployments.frontend.http_body import JSONBody
from deployments.frontend.openai_ingress import OpenAIIngress
from tests.unit.ingress_fakes import HELLO, HTTP, MAX_MODEL_LEN, MODEL, FakeEngine, assert_error, front_end, tokenizer
from tests.unit.ingress_fakes import client, engine  # noqa: F401 (fixtures)

JSON = {"content-type": "application/json"}


def post_raw(client, path: str, raw: bytes):
    return client.post(path, content=raw, headers=JSON)


# -- lone surrogates ---------------------------------------------------------------------------


@pytest.mark.parametrize("path,raw", [
    ("/v1/chat/completions", rb'{"model": "\ud800", "messages": [{"role": "user", "content": "hi"}]}'),
    ("/v1/completions", rb'{"model": "m", "prompt": "hi", "\udfff": 1}'),  # an unknown field's name
    ("/tokenize", rb'{"model": "\ud800", "prompt": "hi"}'),
    ("/detokenize", rb'{"model": "m", "tokens": [1], "\udbff": 1}'),
    ("/v1/completions", b'{"model": "m", "prompt": "a\xed\xa0\x80b"}'),  # the surrogate's UTF-8 bytes
    ("/v1/completions", '{"model": "m", "prompt": "a\ud800b"}'.encode("utf-16-le", "surrogatepass")),
], ids=["model", "field_name", "tokenize_model", "detokenize_field", "utf8_bytes", "utf16_body"])
def test_a_lone_surrogate_anywhere_is_a_400_naming_it(client, engine, path, raw):
    error = assert_error(post_raw(client, path, raw), 400, "invalid_text")
    assert "surrogate" in error["message"]
    assert engine.streams == []


def test_a_surrogate_pair_is_text_not_an_error(client):
    # Python's json.dumps writes every emoji as an escaped pair: that is valid text.
    response = post_raw(client, "/v1/completions", rb'{"model": "m", "prompt": "smile \ud83d\ude00", "max_tokens": 3}')
    assert response.status_code == 200, response.text


def test_a_json_answer_that_repeats_a_lone_surrogate_is_escaped_not_a_crash():
    body = JSONBody({"error": {"message": "model '\ud800' does not exist"}}, status_code=404).body
    assert body == b'{"error":{"message":"model \'\\ud800\' does not exist"}}'
    assert JSONBody({"text": "h\u00e9"}).body == '{"text":"h\u00e9"}'.encode()  # otherwise as Starlette's


# -- fields whose type vLLM's validators assume ------------------------------------------------


@pytest.mark.parametrize("messages", [0, None, -1, 10 ** 30, "hi", {"role": "user", "content": "hi"}])
def test_chat_messages_that_are_not_an_array_are_a_400(client, messages):
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert_error(response, 400, "invalid_value", param="messages")


@pytest.mark.parametrize("path,base", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                       ("/v1/completions", {"prompt": "hi"})])
def test_structured_outputs_that_is_not_an_object_is_a_400(client, path, base):
    response = client.post(path, json={"model": "m", **base, "structured_outputs": 0})
    assert_error(response, 400, "invalid_value", param="structured_outputs")


# A value of the wrong type for each field vLLM's request models declare: a validator that
# assumes a type (as two did, see _check_types_vllm_assumes) shows here as a 5xx.
ODD_VALUES = [0, None, "x", 10 ** 30, [None]]


def _fields(chat: bool) -> list[str]:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return sorted((ChatCompletionRequest if chat else CompletionRequest).model_fields)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_no_field_of_vllms_request_models_gives_a_5xx_for_a_value_of_another_type(client, chat):
    path, base = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) if chat
                  else ("/v1/completions", {"prompt": "hi"}))
    failures = []
    for field in _fields(chat):
        for value in ODD_VALUES:
            response = client.post(path, json={"model": "m", "max_tokens": 2, **base, field: value})
            if response.status_code >= 500:
                failures.append((field, value, response.status_code))
    assert failures == []


# -- body size ---------------------------------------------------------------------------------


def test_a_chunked_body_past_the_limit_is_refused_before_the_rest_is_read():
    """8 MiB sent without a Content-Length, in 1 KiB chunks: the 413 comes after the first
    chunks past the 4 KiB limit, not after the ingress has buffered all 8 MiB."""
    ingress = OpenAIIngress(FakeEngine(script=list(HELLO)), MODEL, HTTP, model_path="unused", front=front_end())

    async def endpoint(request):
        return await ingress(request)

    app = Starlette(routes=[Route("/{path:path}", endpoint, methods=["POST"])])
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    chunk, total_chunks = b"a" * 1024, 8 * 1024
    received, sent = [], []

    async def receive():
        received.append(1)
        return {"type": "http.request", "body": chunk, "more_body": len(received) < total_chunks}

    async def send(message):
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=30))
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "body_too_large"
    assert len(received) <= HTTP["max_request_bytes"] // len(chunk) + 1


# -- /tokenize and /detokenize bounds ----------------------------------------------------------


def _text_limit() -> int:
    return MAX_MODEL_LEN * tokenizer().max_chars_per_token


def test_tokenize_refuses_text_longer_than_the_context_can_hold_naming_the_limit(client):
    limit = _text_limit()
    assert client.post("/tokenize", json={"prompt": "a" * limit}).status_code == 200
    error = assert_error(client.post("/tokenize", json={"prompt": "a" * (limit + 1)}), 400,
                         "context_length_exceeded", param="prompt")
    assert f"{limit} characters" in error["message"] and f"{MAX_MODEL_LEN} tokens" in error["message"]
    half = "a" * (limit // 2 + 1)
    chat = {"messages": [{"role": "user", "content": half}, {"role": "assistant", "content": half}]}
    assert_error(client.post("/tokenize", json=chat), 400, "context_length_exceeded", param="messages")


def test_detokenize_refuses_more_ids_than_the_context_naming_the_limit(client):
    assert client.post("/detokenize", json={"tokens": [1] * MAX_MODEL_LEN}).status_code == 200
    error = assert_error(client.post("/detokenize", json={"tokens": [1] * (MAX_MODEL_LEN + 1)}), 400,
                         "context_length_exceeded", param="tokens")
    assert f"{MAX_MODEL_LEN} tokens" in error["message"]


# -- an unexpected error ------------------------------------------------------------------------


class BrokenFront:
    """vLLM's front end whose render hits a bug carrying internal detail in its message."""

    def __init__(self):
        self.tokenizer = front_end().tokenizer

    async def render(self, chat, body):
        raise RuntimeError("KeyError at /srv/models/secret on 10.0.0.7")


def test_an_unexpected_error_is_a_500_that_shows_no_internal_text():
    from starlette.testclient import TestClient

    ingress = OpenAIIngress(FakeEngine(), MODEL, HTTP, model_path="unused", front=BrokenFront())

    async def endpoint(request):
        return await ingress(request)

    with TestClient(Starlette(routes=[Route("/{path:path}", endpoint, methods=["POST"])])) as http_client:
        response = http_client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert response.status_code == 500
    assert response.json() == {"error": {"message": "internal error", "type": "internal_error", "param": None,
                                         "code": None}}
