"""The OpenAI ingress over HTTP (Starlette TestClient): routes, request handling, errors."""

import inspect
import json

import pytest

from deployments.engine_client import HandleEngineClient
from deployments.frontend.openai_ingress import HEALTH_TIMEOUT_S
from tests.unit.ingress_fakes import HELLO, HTTP, MAX_MODEL_LEN, FakeEngine, assert_error, make_client, tokenizer
from tests.unit.ingress_fakes import client, engine  # noqa: F401 (fixtures)

def test_fakes_have_the_real_interfaces():
    def params(fn):
        return list(inspect.signature(fn).parameters)

    assert inspect.isasyncgenfunction(HandleEngineClient.stream) and inspect.isasyncgenfunction(FakeEngine.stream)
    assert inspect.iscoroutinefunction(HandleEngineClient.health) and inspect.iscoroutinefunction(FakeEngine.health)
    assert params(FakeEngine.stream) == params(HandleEngineClient.stream)
    assert params(FakeEngine.health) == params(HandleEngineClient.health)



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


@pytest.mark.parametrize("error,reason", [
    (TimeoutError("replica 10.0.0.7:8000 did not answer"), "timeout"),
    (RuntimeError("ActorDiedError: replica 10.0.0.7:8000 /home/ray/secret"), "engine pool unhealthy"),
])
def test_health_503_when_the_engine_is_unhealthy_names_no_internals(client, engine, caplog, error, reason):
    # /health is open without an API key: the cause goes to the log, the body says only what kind.
    engine.health_error = error
    response = client.get("/health")
    assert response.status_code == 503
    assert response.json() == {"status": "unhealthy", "reason": reason}
    assert "10.0.0.7" not in response.text and "10.0.0.7" in caplog.text


# -- non-streaming --------------------------------------------------------------------------


def test_completion(client, engine):
    response = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "max_tokens": 3})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "m"
    assert body["id"].startswith("cmpl-") and response.headers["x-request-id"] == body["id"]
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("Hello big world", "length")
    assert choice["token_ids"] is None and body.get("prompt_token_ids") is None
    prompt = tokenizer().encode_prompt("hey")
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 3, "total_tokens": len(prompt) + 3}
    (stream,) = engine.streams
    # The engine's id is the response's plus a suffix of ours: unique, whatever id a client sends.
    assert stream.request.request_id.startswith(body["id"] + "-") and stream.request.request_id != body["id"]
    assert stream.request.prompt_token_ids == prompt
    assert stream.exhausted


def test_completion_returns_token_ids_on_request(client):
    body = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "return_token_ids": True}).json()
    assert body["choices"][0]["token_ids"] == [10, 11, 12]
    assert body["prompt_token_ids"] == tokenizer().encode_prompt("hey")
    assert body["choices"][0]["prompt_token_ids"] == body["prompt_token_ids"]


def test_completion_with_token_id_prompt(client, engine):
    body = client.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7, 8]}).json()
    assert body["usage"]["prompt_tokens"] == 4
    assert engine.streams[0].request.prompt_token_ids == [5, 6, 7, 8]


def test_token_id_outside_vocabulary(client, engine):
    vocab = tokenizer().vocab_size
    response = client.post("/v1/completions", json={"model": "m", "prompt": [5, vocab + 10]})
    error = assert_error(response, 400, "invalid_value", param="prompt")
    assert str(vocab + 10) in error["message"]
    assert engine.streams == []


def test_chat_completion(client, engine):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert (choice["message"]["role"], choice["message"]["content"]) == ("assistant", "Hello big world")
    assert not choice["message"].get("tool_calls")
    assert engine.streams[0].request.prompt_token_ids == tokenizer().encode_chat(messages)


def test_chat_text_parts_are_joined_before_tokenizing(client, engine):
    parts = [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]
    client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": parts}]})
    # As vLLM's server renders text parts for a string-content chat template: joined by newlines.
    assert engine.streams[0].request.prompt_token_ids == tokenizer().encode_chat([{"role": "user", "content": "h\ni"}])


# -- sampling settings handed to the engine ---------------------------------------------------


def test_sampling_params_of_a_completion_are_vllms(client, engine):
    client.post("/v1/completions", json={
        "model": "m", "prompt": "hey", "temperature": 0.7, "top_p": 0.5, "top_k": -1, "seed": 7,
        "stop": ["\n", "END"], "min_tokens": 2, "repetition_penalty": 1.1, "min_p": 0.05,
        "logit_bias": {"5": 10}, "logprobs": 2})
    sampling = engine.streams[0].request.sampling
    assert type(sampling).__name__ == "SamplingParams" and sampling.n == 1
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (16, 0.7, 0.5, -1)
    assert (sampling.seed, sampling.stop, sampling.min_tokens, sampling.repetition_penalty) == (7, ["\n", "END"], 2, 1.1)
    assert (sampling.min_p, sampling.logprobs) == (0.05, 2)
    assert sampling.logit_bias == {5: 10}


def test_nulls_are_accepted_where_openai_accepts_them(client, engine):
    response = client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": None, "top_p": None,
        "max_tokens": None, "stop": None, "seed": None, "tools": None, "response_format": None})
    assert response.status_code == 200, response.text
    sampling = engine.streams[0].request.sampling
    assert (sampling.temperature, sampling.top_p) == (1.0, 1.0)


def test_completion_max_tokens_defaults_to_16(client, engine):
    client.post("/v1/completions", json={"model": "m", "prompt": "hey"})
    assert engine.streams[0].request.sampling.max_tokens == 16


def test_chat_without_max_tokens_gets_the_remaining_context(client, engine):
    messages = [{"role": "user", "content": "hi"}]
    client.post("/v1/chat/completions", json={"model": "m", "messages": messages, "stop": "x"})
    sampling = engine.streams[0].request.sampling
    assert sampling.max_tokens == MAX_MODEL_LEN - len(tokenizer().encode_chat(messages))
    assert sampling.stop == ["x"]
    assert sampling.temperature == 1.0


def test_chat_max_completion_tokens(client, engine):
    client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "max_completion_tokens": 5})
    assert engine.streams[0].request.sampling.max_tokens == 5


def test_n_and_batch_prompts_fan_out_into_single_sequence_requests(client, engine):
    body = client.post("/v1/completions", json={"model": "m", "prompt": [[5, 6], [7, 8]], "n": 2, "seed": 3,
                                                "max_tokens": 3}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "Hello big world" for c in body["choices"])
    requests = sorted((s.request for s in engine.streams), key=lambda r: r.request_id)
    assert [r.prompt_token_ids for r in requests] == [[5, 6], [5, 6], [7, 8], [7, 8]]
    assert [r.sampling.seed for r in requests] == [3, 4, 3, 4]  # child i: seed + i, as vLLM does
    assert all(r.sampling.n == 1 for r in requests)
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}


# -- request errors ---------------------------------------------------------------------------


def test_prompt_as_long_as_the_context(client, engine):
    response = client.post("/v1/completions", json={"model": "m", "prompt": [5] * (MAX_MODEL_LEN + 1),
                                                    "max_tokens": 1})
    error = assert_error(response, 400, "context_length_exceeded")
    assert f"{MAX_MODEL_LEN} tokens" in error["message"]
    assert engine.streams == []


def test_prompt_plus_max_tokens_over_the_context_is_clamped_as_vllm_does(client, engine):
    response = client.post("/v1/completions", json={"model": "m", "prompt": [5] * 60, "max_tokens": 5})
    assert response.status_code == 200
    assert engine.streams[0].request.sampling.max_tokens == 4


def test_prompt_plus_max_tokens_exactly_the_context_is_fine(client, engine):
    response = client.post("/v1/completions", json={"model": "m", "prompt": [5] * 60, "max_tokens": 4})
    assert response.status_code == 200
    assert engine.streams[0].request.sampling.max_tokens == 4


def test_chat_over_the_context(client):
    response = client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": " ".join(["word"] * MAX_MODEL_LEN)}]})
    assert_error(response, 400, "context_length_exceeded")


def test_unknown_model(client, engine):
    response = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hey"})
    error = assert_error(response, 404, "model_not_found")
    assert "gpt-9" in error["message"] and "'m'" in error["message"]
    assert engine.streams == []


def test_validation_error_reaches_the_client(client):
    response = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "max_tokens": "five"})
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


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nested too deep to parse
    b'{"model": "m", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",  # beyond Python's int limit
], ids=["deep_nesting", "huge_integer"])
def test_hostile_json_is_a_400_not_a_500(engine, raw):
    http_client, _ = make_client(engine, http={"max_request_bytes": 1 << 20})
    with http_client:
        response = http_client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(response, 400, "invalid_json")
    assert engine.streams == []


def test_a_lone_surrogate_in_a_prompt_is_a_400(client, engine):
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    response = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    error = assert_error(response, 400, "invalid_text")
    assert "surrogate" in error["message"]
    assert engine.streams == []



def test_clients_sending_the_same_request_id_never_share_an_engine_request_id():
    engine = FakeEngine(script=HELLO)
    with make_client(engine)[0] as client:
        for _ in range(2):
            response = client.post("/v1/completions", json={"model": "m", "prompt": "hey", "request_id": "same"})
            assert response.status_code == 200 and response.json()["id"] == "cmpl-same"
    first, second = (s.request.request_id for s in engine.streams)
    assert first != second and first.startswith("cmpl-same-")


def test_a_long_session_header_is_cut_before_it_keys_the_routers():
    from deployments.frontend.openai_ingress import MAX_SESSION_ID_CHARS

    engine = FakeEngine(script=HELLO)
    with make_client(engine)[0] as client:
        client.post("/v1/completions", json={"model": "m", "prompt": "hey"}, headers={"X-Session-Id": "s" * 16000})
    assert engine.streams[0].request.session_id == "s" * MAX_SESSION_ID_CHARS


def test_an_empty_model_name_asks_for_the_served_model_as_in_vllm():
    engine = FakeEngine(script=HELLO)
    with make_client(engine)[0] as client:
        assert client.post("/v1/completions", json={"model": "", "prompt": "hey"}).status_code == 200
        assert client.post("/v1/completions", json={"model": "other", "prompt": "hey"}).status_code == 404
