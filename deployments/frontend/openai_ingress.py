"""The OpenAI-compatible ingress: parse, validate, tokenize, stream from the engine pool.

Routes: GET /v1/models[/{id}], POST /v1/completions, POST /v1/chat/completions, POST /tokenize,
POST /detokenize, GET /version, GET /health. With API keys configured (manifest http.auth) every
route but /health needs `Authorization: Bearer <key>`.
Every bad request gets an OpenAI-shaped JSON error and a 4xx status; nothing a client sends
can take the ingress down for other clients.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from deployments.errors import (APIError, bad_request, engine_error, not_found, outcome_of, server_error,
                               too_many_requests, unauthorized)
from deployments.frontend import info_routes as info
from deployments.frontend import responses
from deployments.frontend.render import ChoiceOutput
from deployments.frontend.responses import ResponseContext
from deployments.records import EngineFailure, EngineRequest
from deployments.routing.admission import AdmissionGate, AdmissionLimits, Slot
from deployments.routing.router_registry import router_for
from deployments.stream_deadlines import RequestTimeouts, bounded
from deployments.frontend.http_body import JSONBody, check_types_vllm_assumes, read_json_body
from deployments.frontend.stream_merge import ended_then
from deployments.frontend.stream_merge import merged as _merged

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0
# A client's conversation id: requests carrying the same one prefer the same engine replica
# (session affinity of the prefix routing policy), unless that replica is overloaded.
SESSION_HEADER = "X-Session-Id"
# Session ids key the routers' affinity tables (up to 100,000 entries each): a longer header is
# cut to this many characters, so no client can fill those tables with kilobyte-long keys.
MAX_SESSION_ID_CHARS = 128
OPEN_PATHS = {"/health"}  # everything else needs an API key when the manifest configures keys
# Routes whose requests are counted and timed (monitoring/request_metrics.py), by metric label.
GENERATION_ROUTES = {("POST", "/v1/completions"): "completions",
                     ("POST", "/v1/chat/completions"): "chat_completions"}


class OpenAIIngress:
    def __init__(self, engine: Any, model: dict, http: dict, model_path: str, tokenizer: Any = None,
                 prefill: Any = None, allow_fault_injection: bool = False, slo: dict | None = None,
                 metrics: Any = None, admission: dict | None = None, priority_header: str = "X-Priority",
                 local_prefill_below_tokens: int = 0, front: Any = None, request_timeouts: dict | None = None,
                 local_prefill_hit_fraction: float | None = None, decode_pool: str = "decode",
                 prefill_pool: str = "prefill"):
        """engine: the colocated or decode pool; prefill: the prefill pool when disaggregated;
        metrics: whether to export Prometheus metrics, or a monitoring.exporter.MetricsExporter;
        admission: AdmissionLimits fields (cluster.manifest_routing), None to admit everything;
        front: vLLM's render/derender front end (built from the checkpoint when None);
        request_timeouts: the manifest's effective bounds on each wait (None: the CPU defaults)."""
        from deployments.engine_client import as_engine_client
        from deployments.frontend.tokenizer import PromptTokenizer
        from monitoring.exporter import MetricsExporter
        from monitoring.request_metrics import RequestMetrics

        self._timeouts = RequestTimeouts.of(request_timeouts)
        if prefill is not None:
            from deployments.disagg_client import DisaggregatedEngineClient

            self._engine = DisaggregatedEngineClient(
                prefill, engine, allow_fault_injection=allow_fault_injection,
                local_prefill_below_tokens=local_prefill_below_tokens, on_decision=self._count_prefill_decision,
                timeouts=self._timeouts, local_hit_fraction=local_prefill_hit_fraction,
                decode_router=functools.partial(router_for, decode_pool),
                prefill_router=functools.partial(router_for, prefill_pool))
        else:
            self._engine = as_engine_client(engine)
        self._model_name: str = model["name"]
        self._max_model_len: int = model["max_model_len"]
        self._max_request_bytes: int = http["max_request_bytes"]
        self._api_keys = _api_key_check(http.get("auth") or {})
        if front is None:
            from deployments.frontend.render import VLLMFrontEnd

            front = VLLMFrontEnd.from_model(model, model_path, {"tool_parser": model.get("tool_parser"),
                                                                 "reasoning_parser": model.get("reasoning_parser")})
        self._front = front
        self._tokenizer = tokenizer or PromptTokenizer(front.tokenizer)
        self._created = int(time.time())
        slo = slo or {"ttft_ms": 2000, "itl_ms": 200}
        if not isinstance(metrics, MetricsExporter):
            metrics = MetricsExporter(enabled=metrics is None or bool(metrics))
        self._metrics = RequestMetrics(metrics,
                                       ttft_slo_s=slo["ttft_ms"] / 1e3, itl_slo_s=slo["itl_ms"] / 1e3,
                                       disaggregated=prefill is not None)
        self._exporter = metrics
        self._gate = AdmissionGate(AdmissionLimits(**admission)) if admission else None
        if self._gate is not None:
            self._metrics.admitted(0)
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
        trace = (self._metrics.start(GENERATION_ROUTES[key], in_session=bool(request.headers.get(SESSION_HEADER)))
                 if key in GENERATION_ROUTES else None)
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
                self._metrics.failed(trace, outcome_of(exc), getattr(exc, "wait", None))
            return JSONBody(exc.body(), status_code=exc.status, headers=exc.headers)
        except asyncio.CancelledError:
            if trace is not None:
                self._metrics.failed(trace, "cancelled")
            raise
        except Exception:  # a bug must cost one request, not the service
            logger.exception("unhandled error on %s %s", request.method, path)
            if trace is not None:
                self._metrics.failed(trace, "server_error")
            return JSONBody(server_error("internal error").body(), status_code=500)

    def admitted(self) -> int | None:
        """Requests this replica has admitted and not yet given back (None: no admission
        control). Called through a Serve handle by benchmarks and tests, not over HTTP."""
        return self._gate.in_flight if self._gate is not None else None

    # -- routes -------------------------------------------------------------------------------

    async def _models(self, request: Request) -> Response:
        return JSONBody({"object": "list", "data": [self._model_card()]})

    async def _model(self, request: Request) -> Response:
        self._check_model(request.url.path.rstrip("/").rsplit("/v1/models/", 1)[1])
        return JSONBody(self._model_card())

    def _model_card(self) -> dict:
        return info.model_card(self._model_name, self._created, self._max_model_len)

    async def _version(self, request: Request) -> Response:
        return JSONBody(info.versions())

    async def _tokenize(self, request: Request) -> Response:
        return await self._tokenizer_route(request, info.tokenize)

    async def _detokenize(self, request: Request) -> Response:
        return await self._tokenizer_route(request, info.detokenize)

    async def _tokenizer_route(self, request: Request, route: Any) -> Response:
        """/tokenize and /detokenize take an admission place like generation (a flood of them
        gets 429s too), and tokenize in a thread so the loop keeps serving streams meanwhile."""
        slot = self._admit(self._priority(request))
        try:
            body = await self._json_body(request)
            self._check_model_if_named(body)
            work = asyncio.ensure_future(asyncio.to_thread(route, self._tokenizer, self._max_model_len, body))
        except BaseException:
            self._give_back(slot)
            raise
        # A thread cannot be stopped: its place stays taken until it ends, even if the client left.
        work.add_done_callback(functools.partial(self._tokenizer_work_ended, slot))
        return JSONBody(await asyncio.shield(work))

    def _tokenizer_work_ended(self, slot: Slot | None, work: asyncio.Future) -> None:
        self._give_back(slot)
        if not work.cancelled():
            work.exception()  # retrieved: a client who left would otherwise leave it to asyncio's log

    def _check_model_if_named(self, body: object) -> None:
        # An empty name asks for the served model, as vLLM's server takes it.
        if isinstance(body, dict) and isinstance(body.get("model"), str) and body["model"]:
            self._check_model(body["model"])

    async def _health(self, request: Request) -> Response:
        try:
            await self._engine.health(HEALTH_TIMEOUT_S)
        except Exception as exc:
            # /health needs no API key: the cause (exception text, replicas, hosts) goes to the log only.
            logger.warning("health check failed: %s: %s", type(exc).__name__, exc)
            reason = "timeout" if isinstance(exc, TimeoutError) else "engine pool unhealthy"
            return JSONBody({"status": "unhealthy", "reason": reason}, status_code=503)
        return JSONBody({"status": "ok"})

    async def _completions(self, request: Request, trace: Any) -> Response:
        return await self._generate(request, trace, chat=False)

    async def _chat_completions(self, request: Request, trace: Any) -> Response:
        return await self._generate(request, trace, chat=True)

    # -- shared path --------------------------------------------------------------------------


    async def _json_body(self, request: Request) -> object:
        return await read_json_body(request, self._max_request_bytes)

    def _check_model(self, model: str) -> None:
        if model != self._model_name:
            raise not_found(f"model '{model}' does not exist; this endpoint serves '{self._model_name}'",
                            code="model_not_found")

    async def _generate(self, request: Request, trace: Any, *, chat: bool) -> Response:
        # Under overload most requests are refused: refuse them before reading, parsing and
        # rendering them (milliseconds each on the ingress's one loop), so a burst's 429s do not
        # queue behind each other's tokenization. An admitted request takes its place below.
        self._admit(self._priority(request), take=False)
        body = await self._json_body(request)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object", code="invalid_body")
        self._check_model_if_named(body)
        check_types_vllm_assumes(chat, body)
        rendered = await self._front.render(chat, body)
        ctx = ResponseContext(rendered, self._model_name)
        slot = self._admit(self._priority(request), prompt_tokens=sum(len(c.token_ids) for c in rendered.children))
        try:
            return await self._respond(ctx, request, trace, slot)
        except BaseException:
            self._give_back(slot)  # the request ended before its response
            raise

    async def _respond(self, ctx: ResponseContext, request: Request, trace: Any, slot: Slot | None) -> Response:
        """One admitted request's response; its place is given back when every child stream (n > 1,
        batch prompts: one engine request each) has ended, not when the first one has."""
        rendered = ctx.rendered
        trace.dispatch()
        streams = self._child_streams(rendered, request, trace)
        if not rendered.stream:
            try:
                return await self._collect(ctx, streams, trace)
            finally:
                self._give_back(slot)  # _collect returns or raises only once every child stream has ended
        merged = ended_then(_merged(rendered.children, streams), functools.partial(self._give_back, slot))
        first = await anext(merged, None)
        if first is not None and isinstance(first[1], EngineFailure):  # nothing sent yet: an HTTP status
            await merged.aclose()
            raise engine_error(first[1])
        return StreamingResponse(self._sse(ctx, first, merged, trace), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rendered.request_id})

    def _child_streams(self, rendered: Any, request: Request, trace: Any) -> list[AsyncIterator]:
        options = _test_options(request)
        session_id = _session_id(request.headers.get(SESSION_HEADER))
        # The engines' request ids are ours, unique per request: a client's `request_id` names
        # the response only. Two clients sending the same one must not share an engine id
        # (an abort by id on one client's disconnect would end the other's request).
        engine_id = f"{rendered.request_id}-{secrets.token_hex(4)}"
        many = len(rendered.children) > 1
        streams = []
        for child in rendered.children:
            request_id = f"{engine_id}-{child.index}" if many else engine_id
            engine_request = EngineRequest(request_id, child.token_ids, child.sampling, session_id=session_id,
                                           cache_salt=child.cache_salt)
            # Every wait on the engine is bounded: past one, the stream is aborted and ends in WaitExpired.
            streams.append(bounded(self._engine.stream(engine_request, trace=trace, **options),
                                   self._timeouts.for_prompt(len(child.token_ids))))
        return streams

    def _count_prefill_decision(self, reason: str) -> None:
        from monitoring import metrics as m

        self._exporter.inc(m.ROUTING_DECISIONS, pool="prefill", policy="conditional_disaggregation", reason=reason)

    def _priority(self, request: Request) -> str:
        return request.headers.get(self._priority_header, "normal").strip().lower()

    def _admit(self, priority: str, take: bool = True, prompt_tokens: int = 0) -> Slot | None:
        """Take a place in the bounded queue (only check for one: `take=False`, before the
        prompt's length is known), or raise 429 at once (never wait for one). None: no place to
        give back (no gate, or only a check)."""
        if self._gate is None:
            return None
        try:
            got = (self._gate.take if take else self._gate.check)(time.monotonic(), priority, prompt_tokens)
        except ValueError as exc:
            raise bad_request(f"header {self._priority_header}: {exc}", code="invalid_priority") from None
        if isinstance(got, Slot):
            self._metrics.admitted(self._gate.in_flight)
            return got
        if got is not None:
            raise too_many_requests(f"server busy: {got.reason}; retry after {got.retry_after_s}s", got.retry_after_s)
        return None

    def _give_back(self, slot: Slot | None) -> None:
        if slot is not None and slot.held:
            slot.release(time.monotonic())
            self._metrics.admitted(self._gate.in_flight)

    async def _collect(self, ctx: ResponseContext, streams: list[AsyncIterator], trace: Any) -> Response:
        rendered = ctx.rendered

        async def one(child: Any, stream: AsyncIterator) -> ChoiceOutput:
            output = ChoiceOutput()
            try:
                async for item in stream:
                    if isinstance(item, EngineFailure):
                        raise engine_error(item)
                    trace.on_delta(item)
                    ctx.note_cached(child.prompt_index, item)
                    output.add(item)
            finally:
                await stream.aclose()  # also on cancellation: aborts the request in the engine
            return output

        tasks = [asyncio.ensure_future(one(c, s)) for c, s in zip(rendered.children, streams)]
        try:
            outputs = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        choices = await self._front.full_choices(rendered, outputs)
        timing = self._metrics.succeeded(trace)
        return JSONBody(responses.full_response(ctx, choices, [o.token_ids for o in outputs]),
                            headers={"X-Request-Id": rendered.request_id, "Server-Timing": timing})

    async def _sse(self, ctx: ResponseContext, first: tuple | None, merged: AsyncIterator,
                   trace: Any) -> AsyncIterator[bytes]:
        rendered = ctx.rendered
        choice_streams = {c.index: self._front.stream_state(rendered, c) for c in rendered.children}
        outcome, wait = "cancelled", None  # unless the loop below ends otherwise
        try:
            item = first
            while item is not None:
                child, delta = item
                if isinstance(delta, EngineFailure):  # headers are sent: an error event, then [DONE]
                    error = engine_error(delta)
                    outcome, wait = outcome_of(error), getattr(error, "wait", None)
                    yield responses.sse(error.body())
                    break
                trace.on_delta(delta)
                ctx.note_cached(child.prompt_index, delta)
                chunk = await choice_streams[child.index].chunk(delta, self._model_name)
                if chunk is not None and chunk.get("choices"):
                    yield responses.sse(responses.stream_chunk(ctx, chunk, delta.token_ids))
                item = await anext(merged, None)
            else:
                outcome = "ok"
            if rendered.include_usage:
                completion_tokens = sum(s.completion_tokens for s in choice_streams.values())
                yield responses.sse(responses.usage_chunk(ctx, completion_tokens))
            yield responses.SSE_DONE
        except Exception:  # headers are sent: a failure mid-stream ends the stream cleanly, as a value
            outcome = "server_error"
            logger.exception("stream %s failed", rendered.request_id)
            yield responses.sse(server_error("internal error").body())
            yield responses.SSE_DONE
        finally:
            await merged.aclose()  # on client disconnect this cancels the engine requests
            if outcome == "ok":
                self._metrics.succeeded(trace)
            else:
                self._metrics.failed(trace, outcome, wait)


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


def _session_id(header: str | None) -> str | None:
    """The client's conversation id as the routers key it: at most MAX_SESSION_ID_CHARS."""
    return header[:MAX_SESSION_ID_CHARS] if header else None
