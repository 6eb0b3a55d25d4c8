"""The OpenAI endpoint on the real stack (Ray Serve + vLLM on CPU, several local nodes)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.prompt_set import CHAT_CONVERSATIONS, COMPLETION_PROMPTS, MAX_TOKENS, concurrent_prompts

pytestmark = pytest.mark.integration


def _completion(stack, prompt, **extra) -> dict:
    body = {"model": stack.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **extra}
    response = httpx.post(f"{stack.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _read_sse(response: httpx.Response) -> tuple[list[dict], bool]:
    chunks, done = [], False
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            done = True
            break
        chunks.append(json.loads(payload))
    return chunks, done


def _stream(stack, path: str, body: dict) -> tuple[list[int], str, list[dict]]:
    with httpx.stream("POST", f"{stack.base_url}{path}", json={**body, "stream": True, "return_token_ids": True,
                      "stream_options": {"include_usage": True}}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks, done = _read_sse(response)
    assert done, "stream did not end with data: [DONE]"
    token_ids = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids", [])]
    key = "delta" if path.endswith("chat/completions") else None
    text = "".join((ch["delta"].get("content") or "") if key else ch["text"] for c in chunks for ch in c["choices"])
    return token_ids, text, chunks


def test_long_prompt_is_long_enough(reference_outputs):
    assert len(reference_outputs["long"]["prompt_token_ids"]) >= 512


@pytest.mark.parametrize("name", sorted(COMPLETION_PROMPTS))
def test_completions_match_plain_vllm(stack, reference_outputs, name):
    expected = reference_outputs[name]
    body = _completion(stack, COMPLETION_PROMPTS[name])
    choice = body["choices"][0]
    assert body["prompt_token_ids"] == expected["prompt_token_ids"]
    assert choice["token_ids"] == expected["token_ids"]
    assert choice["text"] == expected["text"]
    usage = dict(body["usage"])
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]  # P/D: what the prefill did not compute
    assert usage == {"prompt_tokens": len(expected["prompt_token_ids"]),
                     "completion_tokens": len(expected["token_ids"]),
                     "total_tokens": len(expected["prompt_token_ids"]) + len(expected["token_ids"])}
    assert 0 <= cached < len(expected["prompt_token_ids"])


@pytest.mark.parametrize("name", sorted(COMPLETION_PROMPTS))
def test_streamed_completions_match_plain_vllm(stack, reference_outputs, name):
    expected = reference_outputs[name]
    token_ids, text, chunks = _stream(stack, "/v1/completions", {
        "model": stack.model, "prompt": COMPLETION_PROMPTS[name], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert token_ids == expected["token_ids"]
    assert text == expected["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == len(expected["token_ids"])
    finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finish == ["length"] or finish == ["stop"]


@pytest.mark.parametrize("name", sorted(CHAT_CONVERSATIONS))
@pytest.mark.parametrize("streaming", [False, True], ids=["json", "sse"])
def test_chat_matches_plain_vllm(stack, reference_outputs, name, streaming):
    expected = reference_outputs[name]
    body = {"model": stack.model, "messages": CHAT_CONVERSATIONS[name], "max_tokens": MAX_TOKENS, "temperature": 0}
    if streaming:
        token_ids, text, chunks = _stream(stack, "/v1/chat/completions", body)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    else:
        response = httpx.post(f"{stack.base_url}/v1/chat/completions", json={**body, "return_token_ids": True},
                              timeout=120)
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["object"] == "chat.completion"
        assert data["prompt_token_ids"] == expected["prompt_token_ids"]
        token_ids, text = data["choices"][0]["token_ids"], data["choices"][0]["message"]["content"]
    assert token_ids == expected["token_ids"]
    assert text == expected["text"]


def test_official_openai_client(stack, reference_outputs):
    """The official client (what users run) sees the same greedy text."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [stack.model]
    completion = client.completions.create(model=stack.model, prompt=COMPLETION_PROMPTS["short"],
                                           max_tokens=MAX_TOKENS, temperature=0)
    assert completion.choices[0].text == reference_outputs["short"]["text"]
    stream = client.chat.completions.create(model=stack.model, messages=CHAT_CONVERSATIONS["chat_single"],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        reference_outputs["chat_single"]["text"]


def test_32_concurrent_streams_complete_correctly(stack, reference_outputs):
    prompts = concurrent_prompts(32)

    async def one(client: httpx.AsyncClient, name: str) -> tuple[str, list[int], bool]:
        body = {"model": stack.model, "prompt": prompts[name], "max_tokens": MAX_TOKENS, "temperature": 0,
                "stream": True, "return_token_ids": True}
        token_ids, done = [], False
        async with client.stream("POST", f"{stack.base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    token_ids += [t for ch in json.loads(line[6:])["choices"] for t in ch.get("token_ids", [])]
        return name, token_ids, done

    async def run_all():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(one(client, name) for name in prompts))

    results = asyncio.run(run_all())
    assert len(results) == 32
    for name, token_ids, done in results:
        assert done, f"{name} did not finish"
        assert token_ids == reference_outputs[name]["token_ids"], name


def test_client_disconnect_aborts_request_in_engine(stack, engine_stats):
    before = engine_stats()
    body = {"model": stack.model, "prompt": "Tell me a very long story", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    received = 0
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                received += 1
            if received >= 3:
                break  # leaving the block closes the connection mid-stream
    # 1,500 tokens take well over a minute on this machine; an abort ends the request in seconds.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = engine_stats()
        if stats.aborted_total > before.aborted_total and stats.engine_unfinished_requests == 0 \
                and not stats.in_flight_request_ids:
            break
        time.sleep(0.25)
    assert stats.aborted_total == before.aborted_total + 1
    assert stats.engine_unfinished_requests == 0, "the engine still tracks the dropped request"
    assert stats.in_flight_request_ids == []


BAD_REQUESTS = [
    # (name, path, raw body or json, expected status, expected code, expected param)
    ("malformed_json", "/v1/completions", b'{"model": "x", "prompt": ', 400, "invalid_json", None),
    ("unknown_model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model_not_found", None),
    ("max_tokens_zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("max_tokens_negative", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, 400, "invalid_value", "max_tokens"),
    ("max_tokens_fraction", "/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, 400, "invalid_value",
     "max_tokens"),
    ("temperature_string", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "invalid_value",
     "temperature"),
    ("prompt_number", "/v1/completions", {"prompt": 42}, 400, "invalid_value", "prompt"),
    ("unknown_field", "/v1/completions", {"prompt": "hi", "max_tokenz": 5}, 400, "unknown_field", "max_tokenz"),
    ("content_number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "invalid_value", "messages.0.content"),
    ("no_messages", "/v1/chat/completions", {"messages": []}, 400, "invalid_value", None),
    ("n_two_greedy", "/v1/completions", {"prompt": "hi", "n": 2, "temperature": 0}, 400, "invalid_value", None),
    ("missing_prompt", "/v1/completions", {}, 400, "invalid_value", "prompt"),
    # Both were answered 503 `retry` before vLLM's own validation ran at the ingress:
    ("min_tokens_over_max", "/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, 400,
     "invalid_value", None),
    ("seed_beyond_64_bits", "/v1/completions", {"prompt": "hi", "seed": 2 ** 70}, 400, "invalid_value", "seed"),
    ("body_not_object", "/v1/completions", [1, 2, 3], 400, "invalid_body", None),
]


@pytest.mark.parametrize("name,path,body,status,code,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_openai_error(stack, name, path, body, status, code, param):
    if isinstance(body, dict) and "model" not in body:
        body = {"model": stack.model, **body}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{stack.base_url}{path}", content=content, headers={"Content-Type": "application/json"},
                          timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["param"] == param
    assert error["message"]


def test_prompt_longer_than_context_is_rejected(stack):
    prompt = "token " * (stack.max_model_len + 100)
    response = httpx.post(f"{stack.base_url}/v1/completions", json={"model": stack.model, "prompt": prompt},
                          timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert str(stack.max_model_len) in response.json()["error"]["message"]


def test_oversized_body_and_wrong_routes(stack):
    huge = httpx.post(f"{stack.base_url}/v1/completions", content=b"x" * (5 << 20), timeout=30)
    assert huge.status_code == 413
    assert httpx.get(f"{stack.base_url}/v1/completions", timeout=30).status_code == 405
    assert httpx.get(f"{stack.base_url}/v2/nothing", timeout=30).status_code == 404


def test_service_keeps_serving_after_bad_input(stack, reference_outputs):
    for _ in range(3):
        httpx.post(f"{stack.base_url}/v1/completions", content=b"{{{", timeout=30)
    assert httpx.get(f"{stack.base_url}/health", timeout=30).json() == {"status": "ok"}
    body = _completion(stack, COMPLETION_PROMPTS["short"])
    assert body["choices"][0]["token_ids"] == reference_outputs["short"]["token_ids"]


def test_models_and_health(stack):
    models = httpx.get(f"{stack.base_url}/v1/models", timeout=30).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == stack.model
    assert models["data"][0]["max_model_len"] == stack.max_model_len
    assert httpx.get(f"{stack.base_url}/health", timeout=30).status_code == 200


def test_tokenize_detokenize_model_by_id_and_version(stack, reference_outputs):
    """/tokenize gives exactly the ids the generation routes send (plain vLLM's, for chat too),
    /detokenize inverts it, and /v1/models/{id} and /version answer as vLLM's server does."""
    name = sorted(CHAT_CONVERSATIONS)[0]
    chat = httpx.post(f"{stack.base_url}/tokenize", timeout=30,
                      json={"model": stack.model, "messages": CHAT_CONVERSATIONS[name]}).json()
    assert chat["tokens"] == reference_outputs[name]["prompt_token_ids"]
    assert chat["count"] == len(chat["tokens"]) and chat["max_model_len"] == stack.max_model_len
    prompt = sorted(COMPLETION_PROMPTS)[0]
    plain = httpx.post(f"{stack.base_url}/tokenize", json={"prompt": COMPLETION_PROMPTS[prompt]}, timeout=30).json()
    assert plain["tokens"] == reference_outputs[prompt]["prompt_token_ids"]
    text = httpx.post(f"{stack.base_url}/detokenize", json={"tokens": plain["tokens"]}, timeout=30).json()["prompt"]
    assert COMPLETION_PROMPTS[prompt] in text
    card = httpx.get(f"{stack.base_url}/v1/models/{stack.model}", timeout=30).json()
    assert (card["id"], card["object"]) == (stack.model, "model")
    assert httpx.get(f"{stack.base_url}/v1/models/no-such-model", timeout=30).status_code == 404
    assert httpx.get(f"{stack.base_url}/version", timeout=30).json()["version"]
