"""What an engine server (or one rank of a group) exports: requests in flight and its KV
connector's counters, read from the connector's stats and mirrored into Prometheus counters."""

from __future__ import annotations

from typing import Any

from monitoring import metrics as m
from monitoring.exporter import CounterMirror, MetricsExporter


class EngineServerMetrics:
    def __init__(self, exporter: MetricsExporter, pool: str, rank: int = 0):
        self._exporter = exporter
        self._mirror = CounterMirror(exporter)
        self._pool = pool
        self._rank = str(rank)

    @property
    def enabled(self) -> bool:
        return self._exporter.enabled

    def export(self, in_flight: int, kv: dict, scheduler: Any = None) -> None:
        """`kv`: kv_transfer.counters snapshot plus leases_outstanding (empty when colocated);
        `scheduler`: the engine's SchedulerSnapshot (None when the engine keeps none)."""
        exporter, pool = self._exporter, self._pool
        exporter.set(m.ENGINE_IN_FLIGHT, in_flight, pool=pool, rank=self._rank)
        if scheduler is not None:
            # An idle engine runs no step, so its last report may still count finished work as waiting.
            exporter.set(m.ENGINE_WAITING, scheduler.waiting if in_flight else 0, pool=pool, rank=self._rank)
            exporter.set(m.ENGINE_KV_USAGE, scheduler.kv_cache_usage, pool=pool, rank=self._rank)
        if not kv:
            return
        mirror = self._mirror
        mirror.update(m.KV_PULLS, kv.get("pulls_succeeded_total", 0), pool=pool, outcome="ok")
        mirror.update(m.KV_PULLS, kv.get("pulls_failed_total", 0), pool=pool, outcome="failed")
        mirror.update(m.KV_PULL_SECONDS, kv.get("pull_seconds_total", 0.0), pool=pool)
        mirror.update(m.KV_PULLED_BYTES, kv.get("bytes_loaded_total", 0), pool=pool)
        mirror.update(m.KV_FALLBACKS, kv.get("fallbacks_total", 0), pool=pool)
        mirror.update(m.KV_LEASES_EXPIRED, kv.get("leases_expired_total", 0), pool=pool)
        exporter.set(m.KV_LEASES_OUTSTANDING, kv.get("leases_outstanding", 0), pool=pool, rank=self._rank)
