"""vLLM's own OpenAI request handling at the ingress: an OpenAI request becomes token ids plus
vLLM SamplingParams, and engine tokens become OpenAI responses and stream chunks.

The one adapter to vLLM's scale-out front end (`vllm.entrypoints.scale_out`): ServingRender
(chat template, tools and tool_choice, response_format and structured outputs, the model's
generation_config defaults, every sampling field vLLM accepts) and OnlineDerenderer (tool-call
and reasoning parsers, logprobs). No engine runs here: the ingress tokenizes once and the engine
pools speak tokens in, tokens out, so coverage follows vLLM release by release.

Two rules of our own around it:
- Unknown top-level fields are a 400 naming them (vLLM only logs them; a misspelt `max_token`
  must not be silently ignored).
- `n > 1` and batch prompts are fanned out here into single-sequence engine requests (child i
  of a seeded request gets seed + i, as vLLM's own parallel sampling does), so every path
  (colocated, P/D, expert-parallel) serves them unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from deployments.errors import bad_request
from deployments.frontend.request_checks import (api_error_of, is_error_response, reject_internal_fields,
                                                 reject_unknown_fields, reject_unserved_options, validate_request,
                                                 validation_error)

logger = logging.getLogger(__name__)

# Each sequence is its own engine request: bound what one HTTP request can fan out to (vLLM's
# own limit, VLLM_MAX_N_SEQUENCES, is 16384 per prompt, times up to 1024 prompts).
MAX_SEQUENCES_PER_REQUEST = 128


@dataclass(frozen=True)
class Child:
    """One engine request of an OpenAI request: one prompt, one sequence."""

    index: int  # the choice index in the response (prompt * n + sample)
    prompt_index: int
    token_ids: list[int]
    sampling: Any  # vllm.SamplingParams with n == 1
    # The request's cache_salt: vLLM mixes it into the prompt's block hashes, so requests with
    # different salts (tenants) never share prefix-cache or KV-pool blocks.
    cache_salt: str | None = None


@dataclass
class Rendered:
    """An OpenAI request after vLLM's render: what the engines get and what derender needs."""

    chat: bool
    request_id: str
    request: Any  # vLLM's ChatCompletionRequest / CompletionRequest
    prompts: list[list[int]]
    children: list[Child]
    stream: bool
    include_usage: bool
    parsed: bool  # a tool or reasoning parser turns the output into message fields

    @property
    def top_logprobs(self) -> int | None:
        """How many alternatives per token a chat response shows (None: all, for completions)."""
        return (getattr(self.request, "top_logprobs", None) or 0) if self.chat else None


class VLLMFrontEnd:
    """Render and derender with vLLM's front end, built from the checkpoint (no weights loaded)."""

    def __init__(self, render: Any, derenderer: Any, model_config: Any, model_name: str,
                 structured_outputs: Any = None):
        self._render = render
        self._derenderer = derenderer
        self.model_config = model_config
        self.model_name = model_name
        self.tokenizer = derenderer.renderer.get_tokenizer()
        self._structured_outputs = structured_outputs  # vLLM's StructuredOutputsConfig, as the engines have it

    @classmethod
    def from_model(cls, model: dict, model_path: str, frontend: dict | None = None) -> "VLLMFrontEnd":
        """`frontend`: tool_parser, reasoning_parser, chat_template (manifest model.frontend)."""
        from vllm import AsyncEngineArgs
        from vllm.config import VllmConfig
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
        from vllm.entrypoints.scale_out.render.serving import ServingRender
        from vllm.renderers import renderer_from_config
        from vllm.renderers.chat_utils import load_chat_template
        from vllm.renderers.online_derenderer import OnlineDerenderer
        from vllm.renderers.online_renderer import OnlineRenderer

        frontend = frontend or {}
        # As vLLM's GPU-less render server builds its config: the model's config and tokenizer,
        # no quantization checks, no KV cache, no device.
        args = AsyncEngineArgs(model=model_path, tokenizer=model_path, served_model_name=model["name"],
                               max_model_len=model["max_model_len"], dtype=model["dtype"],
                               reasoning_parser=frontend.get("reasoning_parser") or "")
        model_config = args.create_model_config()
        model_config.quantization = None
        config = VllmConfig(model_config=model_config,
                            structured_outputs_config=args.create_structured_outputs_config())
        renderer = renderer_from_config(config)
        common = dict(model_config=model_config, renderer=renderer, request_logger=None,
                      chat_template=load_chat_template(frontend.get("chat_template")),
                      chat_template_content_format="auto",
                      enable_auto_tools=bool(frontend.get("tool_parser")),
                      tool_parser=frontend.get("tool_parser"), reasoning_parser=frontend.get("reasoning_parser"))
        online = OnlineRenderer(**common)
        online.warmup()
        registry = OpenAIModelRegistry(model_config=model_config,
                                       base_model_paths=[BaseModelPath(name=model["name"], model_path=model_path)])
        return cls(ServingRender(registry, online), OnlineDerenderer(**common), model_config, model["name"],
                   config.structured_outputs_config)

    # -- requests --------------------------------------------------------------------------------

    async def render(self, chat: bool, body: dict) -> Rendered:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.exceptions import VLLMClientError

        model_cls = ChatCompletionRequest if chat else CompletionRequest
        reject_internal_fields(body)
        reject_unknown_fields(model_cls, body)
        request = validate_request(model_cls, body)
        reject_unserved_options(request)
        try:
            if chat:
                result = await self._render.render_chat_request(request)
                generated = [result] if not is_error_response(result) else result
            else:
                generated = await self._render.render_completion_request(request)
        except (VLLMClientError, ValueError, TypeError, KeyError) as exc:
            # vLLM's server answers these 400 too (VLLMValidationError is a ValueError).
            raise validation_error(exc) from None
        if is_error_response(generated):
            raise api_error_of(generated)
        vocab = self.model_config.get_vocab_size()
        for one in generated:  # vLLM's engine rejects these later; answer 400 before any engine work
            outside = next((t for t in one.token_ids if not 0 <= t < vocab), None)
            if outside is not None:
                raise bad_request(f"prompt token id {outside} is outside the vocabulary [0, {vocab})",
                                  param="prompt", code="invalid_value")
        for one in generated:
            self._verify_sampling(one.sampling_params)
        n = request.n or 1
        if n * len(generated) > MAX_SEQUENCES_PER_REQUEST:
            raise bad_request(f"n ({n}) x prompts ({len(generated)}) asks for {n * len(generated)} sequences; "
                              f"one request may ask for at most {MAX_SEQUENCES_PER_REQUEST}", param="n",
                              code="invalid_value")
        children = []
        for prompt_index, one in enumerate(generated):
            for sample in range(n):
                params = one.sampling_params.clone()
                params.n = 1
                if params.seed is not None:
                    params.seed += sample
                children.append(Child(prompt_index * n + sample, prompt_index, list(one.token_ids), params,
                                      cache_salt=getattr(one, "cache_salt", None)))
        request_id = generated[0].request_id.rsplit("-", 1)[0] if not chat and len(generated) > 1 \
            else generated[0].request_id
        options = request.stream_options
        return Rendered(chat=chat, request_id=request_id, request=request,
                        prompts=[list(g.token_ids) for g in generated], children=children,
                        stream=bool(request.stream), include_usage=bool(request.stream and options
                                                                        and options.include_usage),
                        parsed=chat and self._parses(request))

    def _verify_sampling(self, params: Any) -> None:
        """vLLM's engine-side checks of the sampling parameters (logprobs against max_logprobs,
        logit_bias and allowed_token_ids against the vocabulary, stop token ids, structured
        output settings), run here as the engine would: a request the engine would refuse is
        a 400 before any engine work, not a failure of the engine pool. The engine still runs
        them too (its answer, should the two differ, is also a 400: llm_server.invalid_request)."""
        from vllm.exceptions import VLLMClientError

        try:
            params.verify(self.model_config, None, self._structured_outputs, self.tokenizer)
        except (VLLMClientError, ValueError, TypeError) as exc:
            raise validation_error(exc) from None

    def _parses(self, request: Any) -> bool:
        """Whether derender's parsers shape this chat response (as vLLM's server decides): a
        reasoning parser always; a tool parser when the request offers tools it may call."""
        parser = self._derenderer.parser
        if parser is None:
            return False
        if getattr(parser, "reasoning_parser_cls", None) is not None:
            return True
        return bool(request.tools) and request.tool_choice != "none"

    # -- responses -------------------------------------------------------------------------------

    async def full_choices(self, rendered: Rendered, outputs: list["ChoiceOutput"]) -> list[dict]:
        """The response's choices (OpenAI dicts), in index order."""
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensResponse

        by_prompt: dict[int, list[ChoiceOutput]] = {}
        for child, out in zip(rendered.children, outputs):
            by_prompt.setdefault(child.prompt_index, []).append(out)
        responses = []
        for prompt_index, prompt in enumerate(rendered.prompts):
            choices = [o.generate_choice(i, rendered.top_logprobs) for i, o in enumerate(by_prompt[prompt_index])]
            responses.append(GenerateTokensResponse(request_id=rendered.request_id, choices=choices,
                                                    prompt_token_ids=prompt))
        if rendered.chat:
            choices = await self._derenderer.derender_chat(responses[0], rendered.request, rendered.prompts[0])
            dumped = []
            for choice, out in zip(choices, outputs):
                body = choice.model_dump(mode="json")
                if not rendered.parsed:
                    body["message"]["content"] = out.text  # the engine's text honours stop strings
                dumped.append(body)
            return dumped
        choices, _, _ = await self._derenderer.derender_completion(
            responses, [len(p) for p in rendered.prompts], rendered.request, rendered.prompts)
        dumped = []
        for choice, out in zip(choices, outputs):
            body = choice.model_dump(mode="json")
            body["text"] = out.text
            dumped.append(body)
        return dumped

    def stream_state(self, rendered: Rendered, child: Child) -> "ChoiceStream":
        return ChoiceStream(self._derenderer, rendered, child)


@dataclass
class ChoiceOutput:
    """What the engine produced for one choice (accumulated over its deltas)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None  # [(token_id, logprob, rank, [(token_id, logprob, rank), ...]), ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: Any) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason
        if getattr(delta, "stop_reason", None) is not None:
            self.stop_reason = delta.stop_reason

    def generate_choice(self, index: int, top: int | None) -> Any:
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensChoice

        return GenerateTokensChoice(index=index, token_ids=self.token_ids, finish_reason=self.finish_reason,
                                    stop_reason=self.stop_reason, logprobs=generate_logprobs(self.logprobs, top))


def generate_logprobs(entries: list | None, top: int | None = None) -> Any:
    """Our plain per-token logprobs as vLLM's token-id logprobs (derender resolves the text).
    `top`: keep the first `top` alternatives per token, as vLLM's chat server does (-1: all);
    None keeps every one (its completions server returns the sampled token and the top-k)."""
    if entries is None:
        return None
    if top is not None and top != -1:
        entries = [(token_id, logprob, rank, alternatives[:top])
                   for token_id, logprob, rank, alternatives in entries]
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
        GenerateLogProb,
        GenerateLogProbs,
        GenerateLogProbsContent,
    )

    return GenerateLogProbs(content=[
        GenerateLogProbsContent(token_id=token_id, logprob=logprob, rank=rank,
                                top_logprobs=[GenerateLogProb(token_id=t, logprob=lp, rank=r) for t, lp, r in top])
        for token_id, logprob, rank, top in entries])


class ChoiceStream:
    """One choice of a streamed response: vLLM's derender state, carried from chunk to chunk."""

    def __init__(self, derenderer: Any, rendered: Rendered, child: Child):
        self._derenderer = derenderer
        self._rendered = rendered
        self._child = child
        self._state = None
        self._role_sent = False
        self.completion_tokens = 0

    async def chunk(self, delta: Any, model: str) -> dict | None:
        """The OpenAI chunk for one engine delta, or None when it carries nothing to send."""
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            GenerateTokensStreamChoice,
            GenerateTokensStreamResponse,
        )

        self.completion_tokens += len(delta.token_ids)
        if not self._rendered.parsed and delta.logprobs is None:
            return self._plain_chunk(delta)
        choice = GenerateTokensStreamChoice(index=self._child.index, token_ids=delta.token_ids,
                                            finish_reason=delta.finish_reason,
                                            stop_reason=getattr(delta, "stop_reason", None),
                                            logprobs=generate_logprobs(delta.logprobs,
                                                                       self._rendered.top_logprobs))
        generate = GenerateTokensStreamResponse(request_id=self._rendered.request_id, choices=[choice])
        prompt = self._child.token_ids
        if self._rendered.chat:
            chunk, self._state = await self._derenderer.derender_chat_stream(
                model=model, generate_chunk=generate, state=self._state, chat_request=self._rendered.request,
                prompt_tokens=len(prompt), prompt_token_ids=prompt)
        else:
            chunk, self._state = await self._derenderer.derender_completion_stream(
                model=model, generate_chunk=generate, state=self._state, prompt_tokens=len(prompt),
                completion_request=self._rendered.request, prompt_token_ids=prompt)
        self._role_sent = True
        body = chunk.model_dump(mode="json", exclude_unset=True)
        for out in body.get("choices", []):
            if self._rendered.chat:
                message = {k: v for k, v in out.get("delta", {}).items() if v is not None}
                if not self._rendered.parsed:
                    message["content"] = delta.text  # the engine's text honours stop strings
                out["delta"] = message
            else:
                out["text"] = delta.text
        return body


    def _plain_chunk(self, delta: Any) -> dict:
        """The common case (no parser, no logprobs): the engine's text is the whole answer, so
        derender (a second detokenization and a few pydantic objects per token) is skipped."""
        choice: dict = {"index": self._child.index, "logprobs": None, "finish_reason": delta.finish_reason,
                        "stop_reason": getattr(delta, "stop_reason", None)}
        if self._rendered.chat:
            choice["delta"] = {"content": delta.text} if self._role_sent else \
                {"role": "assistant", "content": delta.text}
            self._role_sent = True
        else:
            choice["text"] = delta.text
        return {"choices": [choice]}
