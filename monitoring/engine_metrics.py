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
        for kind in ("refused_request", "refused_connection", "evicted_connection", "accept_error"):
            mirror.update(m.KV_SERVER_REFUSALS, kv.get(f"server_{kind}s_total", 0), pool=pool, kind=kind)
        if "pool_up" in kv:
            self._export_pool(kv)

    def _export_pool(self, kv: dict) -> None:
        """The KV pool tier's counters (kv_transfer.pool.worker_tier.PoolCounts, "pool_" keys)."""
        mirror, pool = self._mirror, self._pool
        hits = kv.get("pool_lookup_hit_blocks_total", 0)
        mirror.update(m.KV_POOL_LOOKUP_BLOCKS, hits, pool=pool, outcome="hit")
        mirror.update(m.KV_POOL_LOOKUP_BLOCKS, kv.get("pool_lookup_blocks_total", 0) - hits, pool=pool, outcome="miss")
        for op, blocks, nbytes, seconds in (("loaded", "blocks_loaded", "bytes_loaded", "load_seconds"),
                                           ("loaded_from_disk", "disk_blocks_loaded", "disk_bytes_loaded",
                                            "disk_load_seconds"),
                                           ("stored", "blocks_stored", "bytes_stored", "store_seconds")):
            mirror.update(m.KV_POOL_BLOCKS, kv.get(f"pool_{blocks}_total", 0), pool=pool, op=op)
            mirror.update(m.KV_POOL_BYTES, kv.get(f"pool_{nbytes}_total", 0), pool=pool, op=op)
            mirror.update(m.KV_POOL_SECONDS, kv.get(f"pool_{seconds}_total", 0.0), pool=pool, op=op)
        for op, key in (("already_pooled", "blocks_already_pooled"), ("refused", "blocks_refused"),
                        ("shed", "blocks_shed"), ("pinned", "blocks_pinned"), ("renewed", "blocks_renewed")):
            mirror.update(m.KV_POOL_BLOCKS, kv.get(f"pool_{key}_total", 0), pool=pool, op=op)
        for op, key in (("lookup", "lookup_failures"), ("load", "load_failures"), ("store", "store_failures"),
                        ("corrupt", "corrupt_objects")):
            mirror.update(m.KV_POOL_FAILURES, kv.get(f"pool_{key}_total", 0), pool=pool, op=op)
        self._exporter.set(m.KV_POOL_UP, kv.get("pool_up", 1), pool=pool, rank=self._rank)
