"""The OpenAI features vLLM's server has, through our stack (the default layout: P/D with an
expert-parallel decode group), compared with vLLM's own OpenAI server on the same checkpoint
and request, with the official `openai` client.

Random tiny weights call no tool by themselves: tool_choice "required" or a named function
(vLLM enforces both with structured outputs) and json_schema responses prove the path. Ids and
timestamps aside, everything is compared: text, token ids, tool calls, logprobs, finish reasons.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.integration.conftest import REPO

pytestmark = pytest.mark.integration

VLLM_SERVER_PORT = 8019
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather like in Paris for the next three days?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "integer"}},
          "required": ["answer", "confidence"]}


@pytest.fixture(scope="module")
def vllm_server(stack, tmp_path_factory):
    """`python -m vllm.entrypoints.openai.api_server` on the stack's checkpoint, as users run it."""
    from cluster.checkpoints import resolve_model_path
    from cluster.manifest import load_manifest

    manifest = load_manifest(stack.manifest_path)
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(resolve_model_path(manifest.model.path)), "--served-model-name", stack.model,
               "--max-model-len", str(manifest.model.max_model_len), "--dtype", manifest.model.dtype,
               "--enforce-eager", "--gpu-memory-utilization", "0.1", "--max-num-seqs", "8",
               "--tool-call-parser", manifest.model.tool_parser, "--enable-auto-tool-choice",
               "--host", "127.0.0.1", "--port", str(VLLM_SERVER_PORT)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    with open(log, "w") as out:
        server = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{VLLM_SERVER_PORT}"
    try:
        deadline = time.monotonic() + 420
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's OpenAI server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def _client(base_url: str):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=300, max_retries=0)


def _both(stack, vllm_server, kind: str, **request) -> tuple[dict, dict]:
    """The same request to our endpoint and to vLLM's server; kind: "chat" or "completions"."""
    def call(base_url: str) -> dict:
        client = _client(base_url)
        api = client.chat.completions if kind == "chat" else client.completions
        return api.create(**request).model_dump()

    return call(stack.base_url), call(vllm_server)


def _choices(body: dict) -> list[dict]:
    """A response's choices without what differs by design (ids of tool calls)."""
    out = []
    for choice in body["choices"]:
        choice = json.loads(json.dumps(choice))
        for call in (choice.get("message") or {}).get("tool_calls") or []:
            call.pop("id", None)
        out.append(choice)
    return out


def _assert_logprobs_close(ours, theirs, tolerance: float = 1e-3):
    """Token strings equal; logprobs within `tolerance` (expert-parallel sums in another order)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        assert ours.keys() == theirs.keys()
        for key in ours:
            _assert_logprobs_close(ours[key], theirs[key], tolerance)
    elif isinstance(ours, list) and isinstance(theirs, list):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            _assert_logprobs_close(a, b, tolerance)
    elif isinstance(ours, float) and isinstance(theirs, float):
        assert abs(ours - theirs) <= tolerance, (ours, theirs)
    else:
        assert ours == theirs


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_calls_equal_vllms(stack, vllm_server, tool_choice):
    ours, theirs = _both(stack, vllm_server, "chat", model=stack.model, messages=MESSAGES, tools=[TOOL],
                         tool_choice=tool_choice, temperature=0, max_tokens=60)
    assert _choices(ours) == _choices(theirs)
    (call,) = ours["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    json.loads(call["function"]["arguments"])  # JSON (vLLM constrains the schema only for strict tools)


def test_json_schema_response_equals_vllms(stack, vllm_server):
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    ours, theirs = _both(stack, vllm_server, "chat", model=stack.model, messages=MESSAGES,
                         response_format=response_format, temperature=0, max_tokens=60)
    assert _choices(ours) == _choices(theirs)
    if ours["choices"][0]["finish_reason"] == "stop":
        assert set(json.loads(ours["choices"][0]["message"]["content"])) == {"answer", "confidence"}


def test_chat_logprobs_equal_vllms(stack, vllm_server):
    ours, theirs = _both(stack, vllm_server, "chat", model=stack.model, messages=MESSAGES, temperature=0,
                         max_tokens=12, logprobs=True, top_logprobs=3)
    assert ours["choices"][0]["message"] == theirs["choices"][0]["message"]
    _assert_logprobs_close(ours["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"])
    assert len(ours["choices"][0]["logprobs"]["content"]) == 12


def test_completions_n_batch_logprobs_and_logit_bias_equal_vllms(stack, vllm_server):
    # n > 1 needs sampling (vLLM refuses it greedy); seeded, so both servers draw alike.
    ours, theirs = _both(stack, vllm_server, "completions", model=stack.model,
                         prompt=["The capital of France is", "One, two, three,"], n=2, temperature=0.8,
                         seed=1234, max_tokens=8, logprobs=2)
    assert [c["index"] for c in ours["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in ours["choices"]] == [c["text"] for c in theirs["choices"]]
    _assert_logprobs_close([c["logprobs"] for c in ours["choices"]], [c["logprobs"] for c in theirs["choices"]])
    # Ours adds prompt_tokens_details.cached_tokens (vLLM only with --enable-prompt-tokens-details).
    assert {**ours["usage"], "prompt_tokens_details": None} == theirs["usage"]
    forced = {"logit_bias": {"42": 100}, "min_p": 0.05}
    ours, theirs = _both(stack, vllm_server, "completions", model=stack.model, prompt="Hello", temperature=0,
                         max_tokens=4, extra_body=forced)
    assert _choices(ours) == _choices(theirs)


def test_streamed_tool_call_equals_vllms(stack, vllm_server):
    def assembled(base_url: str) -> tuple[str, str, str | None]:
        stream = _client(base_url).chat.completions.create(
            model=stack.model, messages=MESSAGES, tools=[TOOL], temperature=0, max_tokens=60, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        name, arguments, finish = "", "", None
        for chunk in stream:
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    name += call.function.name or ""
                    arguments += call.function.arguments or ""
                finish = choice.finish_reason or finish
        return name, arguments, finish

    assert assembled(stack.base_url) == assembled(vllm_server)


def test_tokenize_and_detokenize_equal_vllms(stack, vllm_server):
    body = {"model": stack.model, "messages": MESSAGES}
    ours = httpx.post(f"{stack.base_url}/tokenize", json=body, timeout=30).json()
    theirs = httpx.post(f"{vllm_server}/tokenize", json=body, timeout=30).json()
    assert (ours["tokens"], ours["count"], ours["max_model_len"]) == \
        (theirs["tokens"], theirs["count"], theirs["max_model_len"])
    ours = httpx.post(f"{stack.base_url}/detokenize", json={"model": stack.model, "tokens": ours["tokens"]},
                      timeout=30).json()
    theirs = httpx.post(f"{vllm_server}/detokenize", json={"model": stack.model, "tokens": theirs["tokens"]},
                        timeout=30).json()
    assert ours["prompt"] == theirs["prompt"]
