"""The OpenAI-compatible ingress: parse, validate, tokenize, stream from the engine pool.

Routes: GET /v1/models[/{id}], POST /v1/completions, POST /v1/chat/completions, POST /tokenize,
POST /detokenize, GET /version, GET /health. With API keys configured (manifest http.auth) every
route but /health needs `Authorization: Bearer <key>`.
Every bad request gets an OpenAI-shaped JSON error and a 4xx status; nothing a client sends
can take the ingress down for other clients.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from deployments import openai_responses as out
from deployments.errors import APIError, bad_request, not_found, server_error, too_many_requests, unauthorized
from deployments.frontend import info_routes as info
from deployments.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_request
from deployments.records import EngineFailure, EngineRequest, SamplingSpec, TokenDelta
from deployments.routing.admission import AdmissionGate, AdmissionLimits

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0
# Routes whose requests are counted and timed (monitoring/request_metrics.py), by metric label.
# A client's conversation id: requests carrying the same one prefer the same engine replica
# (session affinity of the prefix routing policy), unless that replica is overloaded.
SESSION_HEADER = "X-Session-Id"
OPEN_PATHS = {"/health"}  # everything else needs an API key when the manifest configures keys
GENERATION_ROUTES = {("POST", "/v1/completions"): "completions",
                     ("POST", "/v1/chat/completions"): "chat_completions"}


class OpenAIIngress:
    def __init__(self, engine: Any, model: dict, http: dict, model_path: str, tokenizer: Any = None,
                 prefill: Any = None, allow_fault_injection: bool = False, slo: dict | None = None,
                 metrics: Any = None, admission: dict | None = None, priority_header: str = "X-Priority",
                 local_prefill_below_tokens: int = 0):
        """engine: the colocated or decode pool; prefill: the prefill pool when disaggregated;
        metrics: whether to export Prometheus metrics, or a monitoring.exporter.MetricsExporter;
        admission: AdmissionLimits fields (cluster.manifest_routing), None to admit everything."""
        from deployments.engine_client import as_engine_client
        from deployments.tokenizer import PromptTokenizer
        from monitoring.exporter import MetricsExporter
        from monitoring.request_metrics import RequestMetrics

        if prefill is not None:
            from deployments.disagg_client import DisaggregatedEngineClient

            self._engine = DisaggregatedEngineClient(
                prefill, engine, allow_fault_injection=allow_fault_injection,
                local_prefill_below_tokens=local_prefill_below_tokens, on_decision=self._count_prefill_decision)
        else:
            self._engine = as_engine_client(engine)
        self._model_name: str = model["name"]
        self._max_model_len: int = model["max_model_len"]
        self._max_request_bytes: int = http["max_request_bytes"]
        self._api_keys = _api_key_check(http.get("auth") or {})
        self._tokenizer = tokenizer or PromptTokenizer.from_path(model_path)
        self._created = int(time.time())
        slo = slo or {"ttft_ms": 2000, "itl_ms": 200}
        if not isinstance(metrics, MetricsExporter):
            metrics = MetricsExporter(enabled=metrics is None or bool(metrics))
        self._metrics = RequestMetrics(metrics,
                                       ttft_slo_s=slo["ttft_ms"] / 1e3, itl_slo_s=slo["itl_ms"] / 1e3,
                                       disaggregated=prefill is not None)
        self._exporter = metrics
        self._gate = AdmissionGate(AdmissionLimits(**admission)) if admission else None
        self._priority_header = priority_header
        self._routes = {
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): self._completions,
            ("POST", "/v1/chat/completions"): self._chat_completions,
            ("GET", "/health"): self._health,
            ("GET", "/version"): self._version,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize,
        }

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        root = request.scope.get("root_path", "")
        if root and root != "/" and path.startswith(root):
            path = path[len(root):] or "/"
        key = (request.method, path.rstrip("/") or "/")
        handler = self._routes.get(key)
        if handler is None and request.method == "GET" and key[1].startswith("/v1/models/"):
            handler = self._model
        trace = self._metrics.start(GENERATION_ROUTES[key]) if key in GENERATION_ROUTES else None
        try:
            if self._api_keys is not None and key[1] not in OPEN_PATHS:
                if not self._api_keys.allows(request.headers.get("authorization")):
                    raise unauthorized()
            if handler is None:
                if any(p == path.rstrip("/") for _, p in self._routes):
                    raise APIError(405, f"method {request.method} not allowed on {path}", code="method_not_allowed")
                raise not_found(f"no route {request.method} {path}; see /v1/models, /v1/completions, "
                                "/v1/chat/completions, /tokenize, /detokenize, /version, /health")
            return await (handler(request) if trace is None else handler(request, trace))
        except APIError as exc:
            if trace is not None:
                outcome = "rejected" if exc.status == 429 else "client_error" if exc.status < 500 else "server_error"
                self._metrics.failed(trace, outcome)
            return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
        except asyncio.CancelledError:
            if trace is not None:
                self._metrics.failed(trace, "cancelled")
            raise
        except Exception:  # a bug must cost one request, not the service
            logger.exception("unhandled error on %s %s", request.method, path)
            if trace is not None:
                self._metrics.failed(trace, "server_error")
            return JSONResponse(server_error("internal error").body(), status_code=500)

    # -- routes -------------------------------------------------------------------------------

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request) -> Response:
        self._check_model(request.url.path.rstrip("/").rsplit("/v1/models/", 1)[1])
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return info.model_card(self._model_name, self._created, self._max_model_len)

    async def _version(self, request: Request) -> Response:
        return JSONResponse(info.versions())

    async def _tokenize(self, request: Request) -> Response:
        body = await self._json_body(request)
        self._check_model_if_named(body)
        return JSONResponse(info.tokenize(self._tokenizer, self._max_model_len, body))

    async def _detokenize(self, request: Request) -> Response:
        body = await self._json_body(request)
        self._check_model_if_named(body)
        return JSONResponse(info.detokenize(self._tokenizer, body))

    def _check_model_if_named(self, body: object) -> None:
        if isinstance(body, dict) and isinstance(body.get("model"), str):
            self._check_model(body["model"])

    async def _health(self, request: Request) -> Response:
        try:
            await self._engine.health(HEALTH_TIMEOUT_S)
        except Exception as exc:
            return JSONResponse({"status": "unhealthy", "reason": f"{type(exc).__name__}: {exc}"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def _completions(self, request: Request, trace: Any) -> Response:
        body = parse_request(CompletionRequest, await self._json_body(request))
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = self._tokenizer.encode_prompt(body.prompt)
        else:
            bad = [t for t in body.prompt if not 0 <= t < self._tokenizer.vocab_size]
            if bad:
                raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary "
                                  f"[0, {self._tokenizer.vocab_size})", param="prompt")
            prompt_ids = list(body.prompt)
        return await self._generate(body, prompt_ids, body.max_tokens, chat=False, prefix="cmpl", trace=trace,
                                    options=_test_options(request), priority=self._priority(request),
                                    session_id=request.headers.get(SESSION_HEADER))

    async def _chat_completions(self, request: Request, trace: Any) -> Response:
        body = parse_request(ChatCompletionRequest, await self._json_body(request))
        self._check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        prompt_ids = self._tokenizer.encode_chat(messages)
        return await self._generate(body, prompt_ids, body.requested_max_tokens(), chat=True, prefix="chatcmpl",
                                    trace=trace, options=_test_options(request), priority=self._priority(request),
                                    session_id=request.headers.get(SESSION_HEADER))

    # -- shared path --------------------------------------------------------------------------


    async def _json_body(self, request: Request) -> object:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self._max_request_bytes:
            raise APIError(413, f"request body of {declared} bytes exceeds the limit of "
                                f"{self._max_request_bytes} bytes", code="body_too_large")
        raw = await request.body()
        if len(raw) > self._max_request_bytes:
            raise APIError(413, f"request body exceeds the limit of {self._max_request_bytes} bytes",
                           code="body_too_large")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None

    def _check_model(self, model: str) -> None:
        if model != self._model_name:
            raise not_found(f"model '{model}' does not exist; this endpoint serves '{self._model_name}'",
                            code="model_not_found")

    def _budget(self, prompt_len: int, max_tokens: int | None) -> int:
        """Output token budget, or a 400 when the request cannot fit the context (as vLLM does)."""
        if prompt_len >= self._max_model_len:
            raise bad_request(f"prompt is {prompt_len} tokens but the model's context is {self._max_model_len} "
                              "tokens; shorten the prompt", param="prompt", code="context_length_exceeded")
        if max_tokens is None:
            return self._max_model_len - prompt_len
        if prompt_len + max_tokens > self._max_model_len:
            raise bad_request(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                              f"context of {self._max_model_len} tokens; lower max_tokens to at most "
                              f"{self._max_model_len - prompt_len}", param="max_tokens",
                              code="context_length_exceeded")
        return max_tokens

    async def _generate(self, body: Any, prompt_ids: list[int], max_tokens: int | None, *, chat: bool,
                        prefix: str, trace: Any, options: dict | None = None, priority: str = "normal",
                        session_id: str | None = None) -> Response:
        sampling = SamplingSpec(
            max_tokens=self._budget(len(prompt_ids), max_tokens),
            temperature=float(body.temperature), top_p=float(body.top_p), top_k=max(body.top_k, 0),
            min_tokens=body.min_tokens, seed=body.seed, stop=body.stop_list(), ignore_eos=body.ignore_eos,
            presence_penalty=float(body.presence_penalty), frequency_penalty=float(body.frequency_penalty),
            repetition_penalty=float(body.repetition_penalty),
        )
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        ctx = out.ResponseContext(
            request_id=request_id, model=self._model_name, chat=chat, prompt_token_ids=prompt_ids,
            return_token_ids=body.return_token_ids,
            include_usage=bool(body.stream_options and body.stream_options.include_usage),
        )
        self._admit(priority)
        trace.dispatch()
        engine_request = EngineRequest(request_id, prompt_ids, sampling, session_id=session_id)
        stream = self._engine.stream(engine_request, trace=trace, **(options or {}))
        if self._gate is not None:
            stream = self._released_when_done(stream)
        if body.stream:
            first = await _first_item(stream)
            if isinstance(first, EngineFailure):
                await stream.aclose()
                raise server_error(first.message, retriable=first.retriable)
            return StreamingResponse(self._sse(ctx, first, stream, trace), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})
        return await self._collect(ctx, stream, trace)

    def _count_prefill_decision(self, reason: str) -> None:
        from monitoring import metrics as m

        self._exporter.inc(m.ROUTING_DECISIONS, pool="prefill", policy="conditional_disaggregation", reason=reason)

    def _priority(self, request: Request) -> str:
        return request.headers.get(self._priority_header, "normal").strip().lower()

    def _admit(self, priority: str) -> None:
        """Take a place in the bounded queue, or raise 429 at once (never wait for one)."""
        if self._gate is None:
            return
        try:
            rejection = self._gate.admit(time.monotonic(), priority)
        except ValueError as exc:
            raise bad_request(f"header {self._priority_header}: {exc}", code="invalid_priority") from None
        if rejection is not None:
            raise too_many_requests(f"server busy: {rejection.reason}; retry after {rejection.retry_after_s}s",
                                    rejection.retry_after_s)

    async def _released_when_done(self, stream: AsyncIterator) -> AsyncIterator:
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()
            self._gate.release(time.monotonic())

    async def _collect(self, ctx: out.ResponseContext, stream: AsyncIterator, trace: Any) -> Response:
        text: list[str] = []
        token_ids: list[int] = []
        finish_reason = None
        try:
            async for item in stream:
                if isinstance(item, EngineFailure):
                    raise server_error(item.message, retriable=item.retriable)
                trace.on_delta(item)
                ctx.note(item)
                text.append(item.text)
                token_ids.extend(item.token_ids)
                finish_reason = item.finish_reason or finish_reason
        finally:
            await stream.aclose()  # also on cancellation: aborts the request in the engine
        timing = self._metrics.succeeded(trace)
        return JSONResponse(out.full_response(ctx, "".join(text), token_ids, finish_reason),
                            headers={"X-Request-Id": ctx.request_id, "Server-Timing": timing})

    async def _sse(self, ctx: out.ResponseContext, first: TokenDelta | None, stream: AsyncIterator,
                   trace: Any) -> AsyncIterator[bytes]:
        completion_tokens = 0
        outcome = "cancelled"  # unless the loop below ends otherwise
        try:
            item = first
            is_first = True
            while item is not None:
                if isinstance(item, EngineFailure):
                    outcome = "server_error"
                    yield out.sse(server_error(item.message, retriable=item.retriable).body())
                    break
                trace.on_delta(item)
                ctx.note(item)
                completion_tokens = item.completion_tokens
                if item.text or item.token_ids or item.finish_reason or (is_first and ctx.chat):
                    yield out.sse(out.stream_chunk(ctx, item.text, item.token_ids, item.finish_reason, first=is_first))
                    is_first = False
                item = await anext(stream, None)
            else:
                outcome = "ok"
            if ctx.include_usage:
                yield out.sse(out.usage_chunk(ctx, completion_tokens))
            yield out.SSE_DONE
        except Exception:  # headers are sent: a failure mid-stream ends the stream cleanly, as a value
            outcome = "server_error"
            logger.exception("stream %s failed", ctx.request_id)
            yield out.sse(server_error("internal error").body())
            yield out.SSE_DONE
        finally:
            await stream.aclose()  # on client disconnect this cancels the engine request
            if outcome == "ok":
                self._metrics.succeeded(trace)
            else:
                self._metrics.failed(trace, outcome)


def _api_key_check(auth: dict):
    """The key check for this replica, or None (and a warning) when the manifest names no keys."""
    from deployments.frontend.api_keys import ApiKeyCheck, load_api_keys

    if not (auth.get("api_keys_env") or auth.get("api_keys_file")):
        logger.warning("no API keys configured (manifest http.auth): every route is open to anyone who can "
                       "reach this endpoint; set http.auth.api_keys_env or api_keys_file to require keys")
        return None
    keys = load_api_keys(auth.get("api_keys_env"), auth.get("api_keys_file"))
    logger.info("API keys required on every route but /health (%d key(s) configured)", len(keys))
    return ApiKeyCheck.of(keys)


INJECT_KV_FAILURE_HEADER = "x-moe-serve-inject-kv-failure"


def _test_options(request: Request) -> dict:
    """Fault injection for tests: honoured only where the manifest allows it (disaggregated)."""
    return {"inject_transfer_failure": True} if request.headers.get(INJECT_KV_FAILURE_HEADER) == "1" else {}


async def _first_item(stream: AsyncIterator) -> Any:
    return await anext(stream, None)
