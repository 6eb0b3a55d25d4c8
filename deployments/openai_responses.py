"""OpenAI response bodies (JSON and SSE chunks) built from our TokenDelta records."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field


@dataclass
class ResponseContext:
    """What every chunk of one response repeats."""

    request_id: str
    model: str
    chat: bool
    prompt_token_ids: list[int]
    return_token_ids: bool = False
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    cached_tokens: int | None = None  # set from the engine's first delta

    def note(self, delta) -> None:
        if self.cached_tokens is None and getattr(delta, "cached_tokens", None) is not None:
            self.cached_tokens = delta.cached_tokens

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.chat else "text_completion"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:  # OpenAI's field: prompt tokens served from cache, not computed
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def full_response(ctx: ResponseContext, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
    choice: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if ctx.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if ctx.return_token_ids:
        choice["token_ids"] = token_ids
    body = {"id": ctx.request_id, "object": ctx.object_name, "created": ctx.created, "model": ctx.model,
            "choices": [choice],
            "usage": usage(len(ctx.prompt_token_ids), len(token_ids), ctx.cached_tokens)}
    if ctx.return_token_ids:
        body["prompt_token_ids"] = ctx.prompt_token_ids
    return body


def stream_chunk(ctx: ResponseContext, text: str, token_ids: list[int], finish_reason: str | None,
                 *, first: bool = False) -> dict:
    choice: dict = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if ctx.chat:
        choice["delta"] = ({"role": "assistant", "content": text} if first else {"content": text})
    else:
        choice["text"] = text
    if ctx.return_token_ids:
        choice["token_ids"] = token_ids
    return {"id": ctx.request_id, "object": ctx.object_name + (".chunk" if ctx.chat else ""),
            "created": ctx.created, "model": ctx.model, "choices": [choice]}


def usage_chunk(ctx: ResponseContext, completion_tokens: int) -> dict:
    return {"id": ctx.request_id, "object": ctx.object_name + (".chunk" if ctx.chat else ""),
            "created": ctx.created, "model": ctx.model, "choices": [],
            "usage": usage(len(ctx.prompt_token_ids), completion_tokens, ctx.cached_tokens)}


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")
