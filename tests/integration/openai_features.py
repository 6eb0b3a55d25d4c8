"""The OpenAI features vLLM's server has, as requests any of our applications can be asked, and
how an answer is compared with vLLM's own server's answer to the same request.

vLLM's answers are collected once per session (`vllm_feature_answers` in conftest.py: vLLM's
OpenAI server on the stack's checkpoint, started, asked every feature, stopped), so each of our
paths is compared with the same answers without a second server: the default P/D +
expert-parallel application (test_openai_features.py), P/D without expert parallelism and with
the KV pool (test_kv_pool_stack.py) and the colocated two-replica application
(test_routing_stack.py).

Random tiny weights call no tool by themselves: tool_choice "required" or a named function
(vLLM enforces both with structured outputs) and json_schema responses prove the path. Ids and
timestamps aside, everything is compared: text, token ids, tool calls, logprobs, finish reasons.
"""

from __future__ import annotations

import json

import httpx

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather like in Paris for the next three days?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "integer"}},
          "required": ["answer", "confidence"]}
NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}

# name -> (kind, request without "model"); kind: chat, completions, chat_stream_tool_call, tokenize
FEATURES: dict[str, tuple[str, dict]] = {
    "tool_choice_required": ("chat", dict(messages=MESSAGES, tools=[TOOL], tool_choice="required", temperature=0,
                                          max_tokens=60)),
    "tool_choice_named": ("chat", dict(messages=MESSAGES, tools=[TOOL], tool_choice=NAMED_TOOL, temperature=0,
                                       max_tokens=60)),
    "json_schema": ("chat", dict(messages=MESSAGES, temperature=0, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})),
    "chat_logprobs": ("chat", dict(messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True, top_logprobs=3)),
    # n > 1 needs sampling (vLLM refuses it greedy); seeded, so both servers draw alike.
    "n_batch_logprobs": ("completions", dict(prompt=["The capital of France is", "One, two, three,"], n=2,
                                             temperature=0.8, seed=1234, max_tokens=8, logprobs=2)),
    "logit_bias_min_p": ("completions", dict(prompt="Hello", temperature=0, max_tokens=4,
                                             extra_body={"logit_bias": {"42": 100}, "min_p": 0.05})),
    "streamed_tool_call": ("chat_stream_tool_call", dict(messages=MESSAGES, tools=[TOOL], tool_choice=NAMED_TOOL,
                                                         temperature=0, max_tokens=60)),
    "tokenize_detokenize": ("tokenize", dict(messages=MESSAGES)),
}


def ask(base_url: str, model: str, name: str, api_key: str = "unused") -> dict:
    """One feature's request to an OpenAI server at base_url; the answer as plain data."""
    import openai

    kind, request = FEATURES[name]
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, timeout=300, max_retries=0)
    if kind == "chat":
        return client.chat.completions.create(model=model, **request).model_dump()
    if kind == "completions":
        return client.completions.create(model=model, **request).model_dump()
    if kind == "chat_stream_tool_call":
        name_parts, arguments, finish = "", "", None
        for chunk in client.chat.completions.create(model=model, stream=True, **request):
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or []:
                    name_parts += call.function.name or ""
                    arguments += call.function.arguments or ""
                finish = choice.finish_reason or finish
        return {"name": name_parts, "arguments": arguments, "finish_reason": finish}
    headers = {"Authorization": f"Bearer {api_key}"}
    tokens = httpx.post(f"{base_url}/tokenize", json={"model": model, **request}, headers=headers,
                        timeout=30).json()
    text = httpx.post(f"{base_url}/detokenize", json={"model": model, "tokens": tokens["tokens"]},
                      headers=headers, timeout=30).json()
    return {"tokens": tokens["tokens"], "count": tokens["count"], "max_model_len": tokens["max_model_len"],
            "prompt": text["prompt"]}


def assert_same_answer(name: str, ours: dict, theirs: dict) -> None:
    """Our answer to feature `name` equals vLLM's (logprobs within 1e-3: expert-parallel sums
    in another order)."""
    if name in ("tool_choice_required", "tool_choice_named"):
        assert _choices(ours) == _choices(theirs)
        (call,) = ours["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        json.loads(call["function"]["arguments"])  # JSON (vLLM constrains the schema only for strict tools)
    elif name == "json_schema":
        assert _choices(ours) == _choices(theirs)
        if ours["choices"][0]["finish_reason"] == "stop":
            assert set(json.loads(ours["choices"][0]["message"]["content"])) == {"answer", "confidence"}
    elif name == "chat_logprobs":
        assert ours["choices"][0]["message"] == theirs["choices"][0]["message"]
        _assert_logprobs_close(ours["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"])
        assert len(ours["choices"][0]["logprobs"]["content"]) == 12
    elif name == "n_batch_logprobs":
        assert [c["index"] for c in ours["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in ours["choices"]] == [c["text"] for c in theirs["choices"]]
        _assert_logprobs_close([c["logprobs"] for c in ours["choices"]], [c["logprobs"] for c in theirs["choices"]])
        # Ours adds prompt_tokens_details.cached_tokens (vLLM only with --enable-prompt-tokens-details).
        assert {**ours["usage"], "prompt_tokens_details": None} == theirs["usage"]
    elif name == "logit_bias_min_p":
        assert _choices(ours) == _choices(theirs)
    elif name == "streamed_tool_call":
        assert ours == theirs
        assert ours["name"] == "get_weather" and ours["arguments"]
    elif name == "tokenize_detokenize":
        assert ours == theirs
    else:
        raise AssertionError(f"no comparison for feature {name!r}")


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
    """Token strings equal; logprobs within `tolerance`."""
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
