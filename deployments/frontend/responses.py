"""OpenAI response bodies around the choices vLLM's derender produced: ids, usage, SSE framing.

Choices themselves (message or text, tool calls, reasoning, logprobs, finish and stop reasons)
come from deployments.frontend.render; this module only adds what one response repeats.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from deployments.frontend.render import Rendered


@dataclass
class ResponseContext:
    rendered: Rendered
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    cached_tokens: dict[int, int] = field(default_factory=dict)  # prompt index -> engine-reported

    def note_cached(self, prompt_index: int, delta) -> None:
        if prompt_index not in self.cached_tokens and getattr(delta, "cached_tokens", None) is not None:
            self.cached_tokens[prompt_index] = delta.cached_tokens

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.rendered.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.rendered.chat else "text_completion"

    @property
    def return_token_ids(self) -> bool:
        return bool(getattr(self.rendered.request, "return_token_ids", False))

    def usage(self, completion_tokens: int) -> dict:
        # Prompt tokens count once per prompt, whatever n is (as vLLM and OpenAI count them).
        prompt_tokens = sum(len(p) for p in self.rendered.prompts)
        body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}
        if self.cached_tokens:  # OpenAI's field: prompt tokens served from cache, not computed
            body["prompt_tokens_details"] = {"cached_tokens": sum(self.cached_tokens.values())}
        return body


def full_response(ctx: ResponseContext, choices: list[dict], token_ids: list[list[int]]) -> dict:
    rendered = ctx.rendered
    if ctx.return_token_ids:
        for choice, child, ids in zip(choices, rendered.children, token_ids):
            choice["token_ids"] = ids
            if not rendered.chat:
                choice["prompt_token_ids"] = rendered.prompts[child.prompt_index]
    body = {"id": rendered.request_id, "object": ctx.object_name, "created": ctx.created, "model": ctx.model,
            "choices": choices, "usage": ctx.usage(sum(len(ids) for ids in token_ids))}
    if ctx.return_token_ids:
        body["prompt_token_ids"] = rendered.prompts[0]
    return body


def stream_chunk(ctx: ResponseContext, derendered: dict, token_ids: list[int]) -> dict:
    """A derendered chunk with our id, created time and, on request, the delta's token ids."""
    derendered.update(id=ctx.rendered.request_id, object=ctx.chunk_object, created=ctx.created, model=ctx.model)
    derendered.pop("usage", None)
    if ctx.return_token_ids:
        for choice in derendered.get("choices", []):
            choice["token_ids"] = token_ids
    return derendered


def usage_chunk(ctx: ResponseContext, completion_tokens: int) -> dict:
    return {"id": ctx.rendered.request_id, "object": ctx.chunk_object, "created": ctx.created, "model": ctx.model,
            "choices": [], "usage": ctx.usage(completion_tokens)}


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")
