"""Requests through vLLM's own render layer (deployments/frontend/render.py) on the tiny
checkpoint: what vLLM's OpenAI server accepts is accepted, what it rejects is a 400 naming the
problem, and our own rule on top (unknown fields are named, not ignored) holds."""

import asyncio

import pytest

from deployments.errors import APIError
from tests.unit.ingress_fakes import MAX_MODEL_LEN, front_end, tokenizer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def render(chat: bool, body: dict):
    # With Qwen3's tool parser, as a manifest sets model.tool_parser: hermes.
    return asyncio.run(front_end("hermes").render(chat, body))


def rejected(chat: bool, body: dict) -> APIError:
    with pytest.raises(APIError) as caught:
        render(chat, body)
    assert caught.value.status == 400
    return caught.value


def test_a_minimal_completion_gets_vllms_defaults():
    rendered = render(False, {"model": "m", "prompt": "hello"})
    (child,) = rendered.children
    assert child.token_ids == tokenizer().encode_prompt("hello")
    assert (child.sampling.max_tokens, child.sampling.temperature, child.sampling.n) == (16, 1.0, 1)
    assert rendered.request_id.startswith("cmpl-") and not rendered.stream


def test_chat_is_rendered_with_the_checkpoints_template():
    rendered = render(True, {**CHAT, "max_completion_tokens": 5})
    assert rendered.prompts == [tokenizer().encode_chat([{"role": "user", "content": "hi"}])]
    assert rendered.children[0].sampling.max_tokens == 5 and rendered.request_id.startswith("chatcmpl-")


@pytest.mark.parametrize("extra", [
    {"tools": [TOOL], "tool_choice": "none"},
    {"tools": [TOOL], "tool_choice": "required"},
    {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tools": [TOOL]},
    {"response_format": {"type": "text"}},
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
    {"logprobs": True, "top_logprobs": 3},
    {"logit_bias": {"7": -100}, "min_p": 0.1, "seed": 2 ** 40},
    {"temperature": None, "top_p": None, "n": None, "stop": None},
])
def test_what_vllms_server_accepts_is_accepted(extra):
    render(True, {**CHAT, **extra})


def test_required_tools_and_json_schema_become_structured_outputs():
    tools = render(True, {**CHAT, "tools": [TOOL], "tool_choice": "required"}).children[0].sampling
    assert tools.structured_outputs is not None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    json_schema = render(True, {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}).children[0].sampling
    assert json_schema.structured_outputs.json == schema


def test_logprobs_reach_the_engine_as_vllm_sampling_params():
    sampling = render(True, {**CHAT, "logprobs": True, "top_logprobs": 3}).children[0].sampling
    assert sampling.logprobs == 3


def test_n_and_batch_prompts_become_children_with_seeds_as_vllm_gives_them():
    rendered = render(False, {"model": "m", "prompt": ["a", "b c"], "n": 3, "seed": 10})
    assert [c.index for c in rendered.children] == list(range(6))
    assert [c.prompt_index for c in rendered.children] == [0, 0, 0, 1, 1, 1]
    assert [c.sampling.seed for c in rendered.children] == [10, 11, 12, 10, 11, 12]
    assert all(c.sampling.n == 1 for c in rendered.children)


def test_unknown_fields_are_named():
    error = rejected(True, {**CHAT, "max_token": 5})
    assert (error.code, error.param) == ("unknown_field", "max_token")
    assert "max_token" in error.message


@pytest.mark.parametrize("chat,body,needle", [
    (True, {**CHAT, "temperature": "hot"}, "temperature"),
    (True, {**CHAT, "messages": []}, "message"),
    (False, {"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    (False, {"model": "m", "prompt": "x", "n": 0}, "n"),
    (True, {**CHAT, "top_logprobs": 3}, "logprobs"),  # top_logprobs needs logprobs: true
    (True, {**CHAT, "tool_choice": "required"}, "tool"),  # a tool choice without tools
])
def test_what_vllm_rejects_is_a_400_naming_it(chat, body, needle):
    error = rejected(chat, body)
    assert needle in (error.message + str(error.param)), error.message


def test_a_prompt_over_the_context_names_the_limit():
    error = rejected(False, {"model": "m", "prompt": [5] * (MAX_MODEL_LEN + 1)})
    assert error.code == "context_length_exceeded" and str(MAX_MODEL_LEN) in error.message


def test_token_ids_outside_the_vocabulary_never_reach_an_engine():
    error = rejected(False, {"model": "m", "prompt": [1, 10 ** 7]})
    assert (error.code, error.param) == ("invalid_value", "prompt") and "10000000" in error.message


def test_one_request_fans_out_to_a_bounded_number_of_sequences():
    from deployments.frontend.render import MAX_SEQUENCES_PER_REQUEST

    ok = render(False, {"model": "m", "prompt": ["a", "b"], "n": MAX_SEQUENCES_PER_REQUEST // 2, "temperature": 1})
    assert len(ok.children) == MAX_SEQUENCES_PER_REQUEST
    error = rejected(False, {"model": "m", "prompt": ["a", "b", "c"], "n": MAX_SEQUENCES_PER_REQUEST // 2,
                             "temperature": 1})
    assert error.param == "n" and str(MAX_SEQUENCES_PER_REQUEST) in error.message


# -- fields that steer internals, and vLLM's engine-side checks -----------------------------------


@pytest.mark.parametrize("field, value", [
    ("kv_transfer_params", {"do_remote_prefill": True, "remote_num_tokens": "x"}),
    ("kv_transfer_params", {"do_remote_decode": True, "lease_s": 3600}),
    ("kv_transfer_params", {}),
    ("vllm_xargs", {"kv_transfer_params": "x"}),
])
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_internal_fields_from_a_client_are_a_400_naming_them(chat, field, value):
    base = CHAT if chat else {"model": "m", "prompt": "hi"}
    error = rejected(chat, {**base, field: value})
    assert error.param == field and "internal" in error.message


def test_internal_fields_set_to_null_mean_not_set():
    rendered = render(False, {"model": "m", "prompt": "hi", "kv_transfer_params": None, "vllm_xargs": None})
    assert not (rendered.children[0].sampling.extra_args or {}).get("kv_transfer_params")


@pytest.mark.parametrize("extra, param", [
    ({"logprobs": True, "top_logprobs": 100}, "logprobs"),  # vLLM's max_logprobs is 20
    ({"logit_bias": {"999999": 5}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
])
def test_what_the_engine_would_refuse_is_a_400_at_render(extra, param):
    error = rejected(True, {**CHAT, **extra})
    assert error.param == param or param in error.message


def test_completion_logprobs_above_the_engines_limit_are_a_400():
    rejected(False, {"model": "m", "prompt": "hi", "logprobs": 21})
    render(False, {"model": "m", "prompt": "hi", "logprobs": 20})  # the limit itself is served


@pytest.mark.parametrize("extra", [{"echo": True}, {"prompt_logprobs": 1}])
def test_options_the_engine_path_cannot_honour_are_refused_not_dropped(extra):
    (name,) = extra
    assert rejected(False, {"model": "m", "prompt": "hi", **extra}).param == name
    render(False, {"model": "m", "prompt": "hi", "echo": False})  # the default stays accepted


def test_cache_salt_reaches_every_child():
    rendered = render(False, {"model": "m", "prompt": ["a", "b"], "n": 2, "cache_salt": "tenant-7"})
    assert [c.cache_salt for c in rendered.children] == ["tenant-7"] * 4
    assert render(False, {"model": "m", "prompt": "a"}).children[0].cache_salt is None
