"""A request's end-to-end latency split into phases (pure: timestamps in, durations out).

The ingress stamps what it sees on its own monotonic clock (body received, handed to the engine
client, prefill result back, first and last token, response complete); the engine that made the
first token reports, on its own clock, how long the request queued and how long from being
scheduled to its first token. Durations from different clocks are never subtracted from each
other: `dispatch` is what the ingress saw between admission and first token minus what the
engine accounts for. It is clamped at zero, so if an engine ever reported more time than the
ingress observed, the phases would add up to more than the end-to-end latency, which the
integration test checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from monitoring.metrics import Phase


@dataclass(frozen=True)
class RequestMarks:
    """Ingress monotonic timestamps of one successful request, in seconds."""

    received: float
    dispatched: float
    first_token: float
    last_token: float
    done: float
    prefill_done: float | None = None  # disaggregated only


def request_phases(marks: RequestMarks, queue_s: float | None, first_token_s: float | None,
                   disaggregated: bool, engine_pool_s: float = 0.0, prefill_pool_s: float = 0.0,
                   engine_pool_disk_s: float = 0.0, prefill_pool_disk_s: float = 0.0) -> dict[Phase, float]:
    """Phase durations of one request; without engine timings their share stays in `dispatch`.
    KV pool reads are carved out of the phase that contains them: the engine's first-token
    phase (its worker loads before the first step) and, disaggregated, the prefill round trip.
    Of a pool read, what the pool's disk tier served is its own phase (`pool_disk_load`)."""
    admitted = marks.prefill_done if marks.prefill_done is not None else marks.dispatched
    phases = {Phase.ingress: marks.dispatched - marks.received}
    pool_s = disk_s = 0.0
    if marks.prefill_done is not None:
        prefill_s = marks.prefill_done - marks.dispatched
        pool_s = min(prefill_pool_s, max(prefill_s, 0.0))
        disk_s = min(prefill_pool_disk_s, pool_s)
        phases[Phase.prefill] = prefill_s - pool_s
    engine_s = 0.0
    if queue_s is not None and first_token_s is not None:
        phases[Phase.queue] = queue_s
        engine_pool_s = min(engine_pool_s, first_token_s)
        pool_s += engine_pool_s
        disk_s += min(engine_pool_disk_s, engine_pool_s)
        phases[Phase.kv_transfer if disaggregated else Phase.first_token_compute] = first_token_s - engine_pool_s
        engine_s = queue_s + first_token_s
    if pool_s - disk_s > 0:
        phases[Phase.pool_load] = pool_s - disk_s
    if disk_s > 0:
        phases[Phase.pool_disk_load] = disk_s
    phases[Phase.dispatch] = max(marks.first_token - admitted - engine_s, 0.0)
    phases[Phase.inter_token] = marks.last_token - marks.first_token
    phases[Phase.finish] = marks.done - marks.last_token
    return {phase: max(seconds, 0.0) for phase, seconds in phases.items()}


def server_timing(phases: dict[Phase, float], total_s: float) -> str:
    """The W3C Server-Timing header value (milliseconds), e.g. for browser dev tools and curl -v."""
    parts = [f"{phase.value};dur={seconds * 1e3:.2f}" for phase, seconds in phases.items()]
    parts.append(f"total;dur={total_s * 1e3:.2f}")
    return ", ".join(parts)
