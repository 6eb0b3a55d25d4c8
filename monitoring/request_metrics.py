"""What the ingress records per request: outcome, latencies, phases, tokens, SLO attainment."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from monitoring import metrics as m
from monitoring.exporter import MetricsExporter
from monitoring.phases import RequestMarks, request_phases, server_timing


@dataclass
class RequestTrace:
    """One request seen from the ingress; fed every delta, finished once."""

    route: str
    received: float
    dispatched: float = 0.0
    prefill_done: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    engine_timing: Any = None  # deployments.records.EngineTiming of the first delta
    engine_pool_load_s: float = 0.0  # the (decode or colocated) engine's KV pool reads
    prefill_pool_load_s: float = 0.0  # disaggregated: the prefill engine's KV pool reads
    engine_pool_disk_s: float = 0.0  # of engine_pool_load_s: what the pool's disk tier served
    prefill_pool_disk_s: float = 0.0  # of prefill_pool_load_s: what the pool's disk tier served
    cached_tokens: int | None = None  # prompt tokens not computed (the first delta's count)
    in_session: bool = False  # the request named its session (X-Session-Id)
    phases: dict = field(default_factory=dict)

    def dispatch(self) -> None:
        self.dispatched = time.monotonic()

    def mark_prefill_done(self, pool_load_s: float = 0.0, pool_disk_load_s: float = 0.0) -> None:
        self.prefill_done = time.monotonic()
        self.prefill_pool_load_s = pool_load_s
        self.prefill_pool_disk_s = pool_disk_load_s

    def on_delta(self, delta: Any) -> None:
        now = time.monotonic()
        if delta.token_ids or delta.text:
            if self.first_token is None:
                self.first_token = now
            self.last_token = now
        if self.engine_timing is None and getattr(delta, "engine_timing", None) is not None:
            self.engine_timing = delta.engine_timing
        if self.cached_tokens is None and getattr(delta, "cached_tokens", None) is not None:
            self.cached_tokens = delta.cached_tokens
        if getattr(delta, "kv_load", None) is not None:
            self.engine_pool_load_s = delta.kv_load.pool_s
            self.engine_pool_disk_s = delta.kv_load.pool_disk_s
        self.prompt_tokens = delta.prompt_tokens
        self.completion_tokens = delta.completion_tokens


class RequestMetrics:
    def __init__(self, exporter: MetricsExporter, *, ttft_slo_s: float, itl_slo_s: float, disaggregated: bool):
        self._exporter = exporter
        self._ttft_slo_s = ttft_slo_s
        self._itl_slo_s = itl_slo_s
        self._disaggregated = disaggregated

    def admitted(self, in_flight: int) -> None:
        """The ingress's admission places now taken; set on every take and release. Labelled by
        process so that replicas sharing a node stay separate series (Ray keeps one value per
        label set of a gauge)."""
        self._exporter.set(m.INGRESS_ADMITTED, in_flight, replica=str(os.getpid()))

    def start(self, route: str, in_session: bool = False) -> RequestTrace:
        return RequestTrace(route=route, received=time.monotonic(), in_session=in_session)

    def failed(self, trace: RequestTrace, outcome: str, wait: str | None = None) -> None:
        """`wait`: for outcome "timeout", the wait that expired (prefill, first_token, ...)."""
        self._exporter.inc(m.REQUESTS, route=trace.route, outcome=outcome)
        if wait:
            self._exporter.inc(m.REQUEST_TIMEOUTS, route=trace.route, wait=wait)

    def succeeded(self, trace: RequestTrace) -> str:
        """Record a completed request; returns its Server-Timing header value."""
        done = time.monotonic()
        first = trace.first_token if trace.first_token is not None else done
        last = trace.last_token if trace.last_token is not None else first
        marks = RequestMarks(trace.received, trace.dispatched or trace.received, first, last, done, trace.prefill_done)
        timing = trace.engine_timing
        phases = request_phases(marks, getattr(timing, "queue_s", None), getattr(timing, "first_token_s", None),
                                self._disaggregated, trace.engine_pool_load_s, trace.prefill_pool_load_s,
                                trace.engine_pool_disk_s, trace.prefill_pool_disk_s)
        trace.phases = phases
        e2e = done - trace.received
        ttft = first - trace.received
        tpot = (last - first) / (trace.completion_tokens - 1) if trace.completion_tokens > 1 else None
        exporter, route = self._exporter, trace.route
        if exporter.enabled:
            exporter.inc(m.REQUESTS, route=route, outcome="ok")
            exporter.observe(m.REQUEST_E2E, e2e, route=route)
            exporter.observe(m.TTFT, ttft, route=route)
            if tpot is not None:
                exporter.observe(m.TPOT, tpot, route=route)
            exporter.inc(m.REQUEST_TIME, e2e, route=route)
            for phase, seconds in phases.items():
                exporter.observe(m.REQUEST_PHASE, seconds, phase=phase.value)
                exporter.inc(m.REQUEST_PHASE_TIME, seconds, phase=phase.value)
            exporter.inc(m.PROMPT_TOKENS, trace.prompt_tokens, route=route)
            exporter.inc(m.PROMPT_CACHED_TOKENS, trace.cached_tokens or 0, route=route)
            if trace.prompt_tokens:
                exporter.observe(m.PROMPT_REUSE_RATIO, min(1.0, (trace.cached_tokens or 0) / trace.prompt_tokens),
                                 route=route, session="yes" if trace.in_session else "no")
            exporter.inc(m.GENERATION_TOKENS, trace.completion_tokens, route=route)
            if ttft <= self._ttft_slo_s and (tpot is None or tpot <= self._itl_slo_s):
                exporter.inc(m.SLO_MET, route=route)
        return server_timing(phases, e2e)
