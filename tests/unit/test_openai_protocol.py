"""OpenAI request schemas: valid requests parse; every bad one is an HTTP 400 naming the field."""

import pytest

from deployments.errors import APIError
from deployments.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_request


def rejected(model, body) -> APIError:
    with pytest.raises(APIError) as info:
        parse_request(model, body)
    assert info.value.status == 400
    assert info.value.type == "invalid_request_error"
    return info.value


def completion(**fields) -> dict:
    return {"model": "m", "prompt": "hello", **fields}


def chat(**fields) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


def test_minimal_completion_gets_openai_defaults():
    req = parse_request(CompletionRequest, completion())
    assert req.prompt == "hello"
    assert req.max_tokens == 16
    assert req.temperature == 1.0
    assert req.stream is False
    assert req.stop_list() == ()


def test_full_completion():
    req = parse_request(CompletionRequest, completion(
        max_tokens=8, temperature=0, top_p=0.5, top_k=4, seed=3, stop=["\n", "."], stream=True,
        stream_options={"include_usage": True}, return_token_ids=True, user="u", n=1))
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed) == (8, 0, 0.5, 4, 3)
    assert req.stop_list() == ("\n", ".")
    assert req.stream and req.stream_options.include_usage and req.return_token_ids


def test_single_stop_string_becomes_a_list():
    assert parse_request(CompletionRequest, completion(stop="END")).stop_list() == ("END",)


def test_list_of_token_ids_prompt_is_accepted():
    assert parse_request(CompletionRequest, completion(prompt=[1, 2, 3])).prompt == [1, 2, 3]


def test_chat_request_parses_messages_and_text_parts():
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ], "max_completion_tokens": 5})
    assert [m.role for m in req.messages] == ["system", "user"]
    assert req.messages[1].text() == "ab"
    assert req.requested_max_tokens() == 5


def test_chat_max_tokens_is_optional():
    assert parse_request(ChatCompletionRequest, chat()).requested_max_tokens() is None
    assert parse_request(ChatCompletionRequest, chat(max_tokens=7)).requested_max_tokens() == 7


def test_unknown_field_is_named():
    error = rejected(CompletionRequest, completion(max_token=5))
    assert (error.param, error.code) == ("max_token", "unknown_field")
    assert "max_token" in error.message


def test_unknown_field_inside_a_message():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi", "mood": "happy"}]}
    error = rejected(ChatCompletionRequest, body)
    assert (error.param, error.code) == ("messages.0.mood", "unknown_field")


def test_missing_model():
    error = rejected(CompletionRequest, {"prompt": "x"})
    assert (error.param, error.code) == ("model", "missing_field")


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "16"),       # no string-to-int coercion
    ("max_tokens", 1.5),
    ("temperature", True),      # a bool is not a number here
    ("temperature", "0.7"),
    ("stream", "yes"),
    ("seed", 1.0),
])
def test_wrong_types_are_rejected(field, value):
    error = rejected(CompletionRequest, completion(**{field: value}))
    assert (error.param, error.code) == (field, "invalid_value")
    assert repr(value) in error.message


def test_int_prompt_is_rejected():
    error = rejected(CompletionRequest, completion(prompt=5))
    assert error.param == "prompt"
    assert "(got 5)" in error.message


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_max_tokens_must_be_positive(max_tokens):
    error = rejected(CompletionRequest, completion(max_tokens=max_tokens))
    assert error.param == "max_tokens"
    assert "greater than or equal to 1" in error.message


def test_temperature_above_two():
    error = rejected(CompletionRequest, completion(temperature=2.5))
    assert error.param == "temperature"
    assert "less than or equal to 2" in error.message


def test_temperature_bounds_are_inclusive():
    assert parse_request(CompletionRequest, completion(temperature=2)).temperature == 2
    assert parse_request(CompletionRequest, completion(temperature=0.0)).temperature == 0


@pytest.mark.parametrize("field, value", [("n", 2), ("echo", True), ("logprobs", 1), ("suffix", "x")])
def test_openai_fields_we_cannot_honour(field, value):
    error = rejected(CompletionRequest, completion(**{field: value}))
    assert (error.param, error.code) == (field, "unsupported_parameter")


def test_chat_tools_are_unsupported():
    error = rejected(ChatCompletionRequest, chat(tools=[{"type": "function"}]))
    assert (error.param, error.code) == ("tools", "unsupported_parameter")


def test_unknown_chat_role():
    error = rejected(ChatCompletionRequest, {"model": "m", "messages": [{"role": "robot", "content": "hi"}]})
    assert error.param == "messages.0.role"
    assert "'robot'" in error.message


def test_empty_messages():
    error = rejected(ChatCompletionRequest, {"model": "m", "messages": []})
    assert error.param == "messages"
    assert "at least 1" in error.message


def test_bad_content_part_names_the_part_field():
    # The union's "should be a string" branch must not hide the real problem inside the list.
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]}
    error = rejected(ChatCompletionRequest, body)
    assert error.param == "messages.0.content.0.type"
    assert "'image_url'" in error.message


@pytest.mark.parametrize("body", [[], "prompt", 3, None])
def test_non_object_body(body):
    error = rejected(CompletionRequest, body)
    assert error.code == "invalid_body"
    assert "JSON object" in error.message


def test_empty_prompt_string():
    error = rejected(CompletionRequest, completion(prompt=""))
    assert error.param == "prompt"
    assert "must not be empty" in error.message


def test_empty_prompt_list_says_list_not_string():
    error = rejected(CompletionRequest, completion(prompt=[]))
    assert error.param == "prompt"
    assert "at least 1 item" in error.message


def test_bad_token_id_in_prompt_list_names_the_position():
    error = rejected(CompletionRequest, completion(prompt=[1, "a"]))
    assert error.param == "prompt.1"
    assert "valid integer" in error.message


def test_stop_list_is_bounded_and_typed():
    assert rejected(CompletionRequest, completion(stop=["a"] * 9)).param == "stop"
    assert rejected(CompletionRequest, completion(stop=["a", 1])).param == "stop.1"


def test_first_error_field_wins_when_several_fields_are_bad():
    # prompt is bad in both union members; max_tokens is bad too. The error is about prompt.
    error = rejected(CompletionRequest, completion(prompt=5, max_tokens=0))
    assert error.param == "prompt"


def test_error_body_has_openai_shape():
    body = rejected(CompletionRequest, completion(n=2)).body()
    assert set(body) == {"error"}
    assert body["error"]["param"] == "n"
    assert body["error"]["code"] == "unsupported_parameter"
    assert body["error"]["type"] == "invalid_request_error"
    assert "n=1" in body["error"]["message"]
