"""The HTTP body of an OpenAI request, read and checked before anything else looks at it, and
the JSON answer class: the parts of the ingress that only know bytes, JSON and vLLM's request
models' assumptions about them."""

from __future__ import annotations

import json
import re
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from deployments.errors import APIError, bad_request


async def read_json_body(request: Request, max_bytes: int) -> object:
    """The parsed body; a 413 past `max_bytes`, a 400 for text that is not JSON or holds a lone
    surrogate."""
    raw = await read_body(request, max_bytes)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # JSONDecodeError and UnicodeDecodeError are ValueErrors, as is an integer of more than
        # 4300 digits; JSON nested thousands deep exhausts the parser's recursion.
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
        raise bad_request(f"request body is not valid JSON: {reason}", code="invalid_json") from None
    # Before anything reads the body: a lone surrogate in any string (the model's name, a field's
    # name, the text) is not Unicode text, and the tokenizer's own error would not say so.
    if _may_hold_lone_surrogate(raw) and _has_lone_surrogate(body):
        raise bad_request("the request contains a lone UTF-16 surrogate (\\ud800-\\udfff), which is not "
                          "valid Unicode text", code="invalid_text")
    return body


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with a 413 as soon as it passes the limit: a body without a
    Content-Length (chunked) is counted while it arrives, never buffered whole first."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {max_bytes} bytes",
                       code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise APIError(413, f"request body exceeds the limit of {max_bytes} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


class JSONBody(JSONResponse):
    """Starlette's JSONResponse, except that a lone surrogate (a client can put one in any string
    that an answer repeats) is written as a \\u escape instead of failing to encode as UTF-8."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def check_types_vllm_assumes(chat: bool, body: dict) -> None:
    """vLLM's request models read these fields in `mode="before"` validators that assume their
    JSON type, so another type raises TypeError or AttributeError, not a validation error, and
    would be a 500 (vLLM 0.32: ChatCompletionRequest.check_system_message_content_type iterates
    `messages`, check_structured_outputs_count calls `structured_outputs.get`)."""
    if chat and not isinstance(body.get("messages", []), list):
        raise bad_request("invalid 'messages': must be an array of messages", param="messages", code="invalid_value")
    if not isinstance(body.get("structured_outputs"), (dict, type(None))):
        raise bad_request("invalid 'structured_outputs': must be an object", param="structured_outputs",
                          code="invalid_value")


# JSON text carries a lone surrogate only through a \uD800-\uDFFF escape, UTF-8-encoded surrogate
# bytes (json.loads decodes with surrogatepass), or UTF-16/32 text (which always has NUL bytes).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")


def _may_hold_lone_surrogate(raw: bytes) -> bool:
    """A fast pre-test (a few ms for 4 MiB) for the exact one below."""
    return bool(_SURROGATE_ESCAPE.search(raw) or b"\x00" in raw
                or (not raw.isascii() and _SURROGATE_BYTES.search(raw)))


def _has_lone_surrogate(body: object) -> bool:
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
