"""Checks of an OpenAI request body around vLLM's request models, before render: internal
fields refused, unknown fields named, options our engine path cannot honour refused, and
vLLM's validation errors (pydantic's, its own) turned into 400s that name the field."""

from __future__ import annotations

from typing import Any

from deployments.errors import APIError, bad_request


# Fields of vLLM's request models that steer the engines' internals: kv_transfer_params names
# KV blocks to pull and leases to keep, vllm_xargs lands in the engine's extra_args (where the
# KV connector reads its parameters). Only our own servers set them; from a client they are a
# 400 naming the field (vLLM's own server accepts both: it trusts its clients with them). null
# means "not set", as in vLLM's models, and is accepted.
INTERNAL_FIELDS = ("kv_transfer_params", "vllm_xargs")


def reject_internal_fields(body: dict) -> None:
    for name in INTERNAL_FIELDS:
        if body.get(name) is not None:
            raise bad_request(f"field '{name}' is internal to the serving system and may not be set by clients",
                              param=name, code="unsupported_field")


def reject_unserved_options(request: Any) -> None:
    """Options vLLM accepts that our engine path cannot honour yet: refused by name rather than
    silently dropped (an answer without the prompt's text or logprobs would look correct)."""
    if getattr(request, "echo", False):
        raise bad_request("'echo' is not supported by this endpoint", param="echo", code="unsupported_field")
    if getattr(request, "prompt_logprobs", None) is not None:
        raise bad_request("'prompt_logprobs' is not supported by this endpoint", param="prompt_logprobs",
                          code="unsupported_field")


def reject_unknown_fields(model_cls: type, body: dict) -> None:
    known = set(model_cls.model_fields)
    known |= {f.alias for f in model_cls.model_fields.values() if f.alias}
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise bad_request(f"unknown field '{unknown[0]}'", param=unknown[0], code="unknown_field")


def validate_request(model_cls: type, body: dict) -> Any:
    from pydantic import ValidationError
    from vllm.exceptions import VLLMClientError

    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(p) for p in error["loc"] if _is_field(p)) or None
        if error["type"] == "missing":
            raise bad_request(f"missing required field '{param}'", param=param, code="missing_field") from None
        raise bad_request(f"invalid '{param}': {error['msg']}" if param else error["msg"], param=param,
                          code="invalid_value") from None
    # vLLM's model validators raise these directly; TypeError and AttributeError come from its
    # `mode="before"` validators reading the client's raw JSON as the type they expect.
    except (VLLMClientError, ValueError, TypeError, AttributeError) as exc:
        raise validation_error(exc) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_field(part: object) -> bool:
    # pydantic puts union members' type names in an error's location ("prompt.list[int]",
    # "messages.0.ChatCompletionUserMessageParam.content.str"); clients need the field path only.
    if isinstance(part, int):
        return True
    text = str(part)
    return not (text[:1].isupper() or "[" in text or "-" in text or text in _TYPE_TAGS)


def validation_error(exc: Exception) -> APIError:
    message = str(exc)
    param = getattr(exc, "parameter", None)
    code = "context_length_exceeded" if "context length" in message else "invalid_value"
    return bad_request(message, param=param, code=code)


def is_error_response(result: Any) -> bool:
    return type(result).__name__ == "ErrorResponse"


def api_error_of(response: Any) -> APIError:
    info = response.error
    status = info.code if isinstance(info.code, int) and 400 <= info.code < 600 else 400
    message = info.message
    code = "context_length_exceeded" if "context length" in message or "maximum context" in message else None
    return APIError(status, message, param=info.param, code=code)
