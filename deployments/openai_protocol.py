"""OpenAI request schemas: what /v1/completions and /v1/chat/completions accept.

Unknown fields are rejected (HTTP 400 naming the field): a misspelt `max_token` must not be
silently ignored. Fields OpenAI defines but we cannot honour (n > 1, logprobs, tools) are
rejected by value with a message that says so, rather than ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError, field_validator

from deployments.errors import APIError, bad_request

Number = StrictInt | StrictFloat


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[StrictInt, Field(ge=-1)] = -1
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    seed: StrictInt | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=8)] | None = None
    ignore_eos: StrictBool = False
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[Number, Field(gt=0.0, le=2.0)] = 1.0
    n: Literal[1] = 1
    user: StrictStr | None = None
    return_token_ids: StrictBool = False
    """Extension (as in vLLM): include prompt and output token ids in the response."""

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: StrictStr | Annotated[list[StrictInt], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] = 16
    echo: Literal[False] = False
    logprobs: None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if isinstance(value, str) and not value:
            raise ValueError("prompt must not be empty")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None
    tools: None = None
    tool_choice: None = None
    response_format: None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse_request(model: type[BaseModel], body: object) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes an HTTP 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_body")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _to_api_error(exc) from None


def _to_api_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    # A union field reports one error per member; "wrong type for member X" errors say nothing
    # when the input has the other member's type (prompt=[] is not "should be a string"), so
    # prefer the error from the member the input actually matched.
    field = errors[0]["loc"][:1]
    error = next((e for e in errors if e["loc"][:1] == field and not _wrong_union_member(e)), errors[0])
    param = ".".join(str(p) for p in error["loc"] if not _is_union_tag(p)) or None
    kind = error["type"]
    if kind == "extra_forbidden":
        return bad_request(f"unknown field '{param}'", param=param, code="unknown_field")
    if kind == "missing":
        return bad_request(f"missing required field '{param}'", param=param, code="missing_field")
    unsupported = {"n": "only n=1 is supported", "echo": "echo is not supported",
                   "logprobs": "logprobs are not supported", "suffix": "suffix is not supported",
                   "tools": "tool calling is not supported", "tool_choice": "tool calling is not supported",
                   "response_format": "response_format is not supported"}
    if param in unsupported:
        return bad_request(f"'{param}': {unsupported[param]}", param=param, code="unsupported_parameter")
    return bad_request(f"invalid '{param}': {error['msg']} (got {error.get('input')!r:.80})", param=param,
                       code="invalid_value")


def _is_union_tag(part: object) -> bool:
    # pydantic adds the union member's type to the location ("prompt.str"); clients need the field.
    return isinstance(part, str) and (part in {"str", "int", "float", "list[int]", "list[str]"}
                                      or part.startswith(("constrained-", "list[", "function-")))


def _wrong_union_member(error: dict) -> bool:
    # The input's own type mismatched this member (the location ends at the member's tag).
    return error["type"].endswith("_type") and _is_union_tag(error["loc"][-1])
