"""Observations for the controller, read from Prometheus with the queries monitoring/ uses.

The one place that knows which metric feeds which observation field (latencies and rates over
the settings' metrics window):
- ttft_p90_s (prefill, colocated) and itl_p90_s (decode, colocated): the ingress's latency
  histograms (every request crosses both pools of a disaggregated layout, so these are the
  pools' SLO signals);
- queue_depth: requests waiting for the pool: at Serve handles plus in its engines' schedulers;
- running: requests inside the pool's engines (our in-flight gauge, summed over ranks);
- kv_cache_usage: the fullest KV cache of the pool's engines;
- kv_transfer_s: the decode pool's mean KV pull latency;
- arrival_rps: requests per second arriving at the ingress;
- metrics_age_s: age of the pool's newest engine sample (stale => the controller holds).
Replica counts come from the caller (Serve knows them better than a scrape).
`observe` returns None when Prometheus cannot be reached: the controller then holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from autoscaler.observations import NO_SAMPLES_AGE_S, PoolObservation
from monitoring import queries as q

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolRef:
    pool: str  # the Serve deployment name
    role: str  # prefill, decode or colocated
    ranks_per_replica: int = 1


class PrometheusSource:
    def __init__(self, api: Any, pools: list[PoolRef], window: str = "2m"):
        """`api`: monitoring.prometheus_api.PrometheusAPI (or a fake with `query(expr)`);
        `window`: PromQL range of the latency percentiles and rates, e.g. "2m" or "30s"."""
        self._api = api
        self._pools = pools
        self.window = window

    def observe(self, replicas: dict[str, int], starting: dict[str, int] | None = None
                ) -> list[PoolObservation] | None:
        try:
            ttft = self._scalar(q.ttft_p90(self.window))
            itl = self._scalar(q.itl_p90(self.window))
            arrivals = self._scalar(q.arrival_rps(self.window))
            kv = self._scalar(q.kv_pull_latency(self.window))
            out = []
            for ref in self._pools:
                age = self._scalar(q.pool_metrics_age(ref.pool))
                out.append(PoolObservation(
                    pool=ref.pool, role=ref.role, replicas=replicas.get(ref.pool, 0),
                    ranks_per_replica=ref.ranks_per_replica,
                    ttft_p90_s=ttft if ref.role in ("prefill", "colocated") else None,
                    itl_p90_s=itl if ref.role in ("decode", "colocated") else None,
                    queue_depth=self._scalar(q.pool_queued(ref.pool)) or 0.0,
                    running=self._scalar(q.pool_running(ref.pool)) or 0.0,
                    kv_cache_usage=self._scalar(q.pool_kv_usage(ref.pool)) if ref.role != "prefill" else None,
                    kv_transfer_s=kv if ref.role == "decode" else None,
                    arrival_rps=arrivals,
                    metrics_age_s=NO_SAMPLES_AGE_S if age is None else max(age, 0.0),
                    starting_replicas=min((starting or {}).get(ref.pool, 0), replicas.get(ref.pool, 0)),
                ))
            return out
        except Exception as exc:  # unreachable or rejected: the controller holds and says why
            logger.warning("autoscaler: Prometheus unavailable (%s); holding", exc)
            return None

    def _scalar(self, expr: str) -> float | None:
        """The query's value (summed if several series); None when it has no data or is NaN."""
        samples = self._api.query(expr)
        values = [s.value for s in samples if s.value == s.value]  # drop NaN (no traffic in the window)
        return sum(values) if values else None
