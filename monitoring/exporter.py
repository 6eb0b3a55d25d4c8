"""The one adapter to Ray's metrics pipeline (ray.util.metrics) for the catalogue's metrics.

Ray's metrics agent on each node serves what the processes of that node record, so one
Prometheus job over Ray's service-discovery file scrapes ours, Ray Serve's and vLLM's (whose
Ray stat logger records through the same pipeline). Metrics are created on first use;
`MetricsExporter(enabled=False)` records nothing (the overhead benchmark's baseline).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from monitoring.metrics import Kind, MetricDef

logger = logging.getLogger(__name__)


def ray_metric_name(metric: MetricDef) -> str:
    """Ray appends `_total` to counters itself; give it the name without."""
    if metric.kind is Kind.counter and metric.name.endswith("_total"):
        return metric.name[: -len("_total")]
    return metric.name


class MetricsExporter:
    def __init__(self, enabled: bool = True, backend: Any = None):
        """`backend`: a module with Counter/Gauge/Histogram like ray.util.metrics (tests pass fakes)."""
        self.enabled = enabled
        self._backend = backend
        self._metrics: dict[str, Any] = {}
        self._lock = threading.Lock()

    def inc(self, metric: MetricDef, value: float = 1.0, **labels: str) -> None:
        if self.enabled and value > 0:
            self._get(metric).inc(value, tags=labels)

    def set(self, metric: MetricDef, value: float, **labels: str) -> None:
        if self.enabled:
            self._get(metric).set(value, tags=labels)

    def observe(self, metric: MetricDef, value: float, **labels: str) -> None:
        if self.enabled:
            self._get(metric).observe(value, tags=labels)

    def _get(self, metric: MetricDef) -> Any:
        recorder = self._metrics.get(metric.name)
        if recorder is not None:
            return recorder
        with self._lock:
            recorder = self._metrics.get(metric.name)
            if recorder is None:
                recorder = self._create(metric)
                self._metrics[metric.name] = recorder
        return recorder

    def _create(self, metric: MetricDef) -> Any:
        backend = self._backend
        if backend is None:
            from ray.util import metrics as backend
        name, tags = ray_metric_name(metric), tuple(metric.labels)
        if metric.kind is Kind.counter:
            return backend.Counter(name, description=metric.help, tag_keys=tags)
        if metric.kind is Kind.gauge:
            return backend.Gauge(name, description=metric.help, tag_keys=tags)
        return backend.Histogram(name, description=metric.help, boundaries=list(metric.buckets), tag_keys=tags)


class CounterMirror:
    """Exports cumulative counts read elsewhere (e.g. a connector's counters) as increments."""

    def __init__(self, exporter: MetricsExporter):
        self._exporter = exporter
        self._last: dict[tuple, float] = {}

    def update(self, metric: MetricDef, total: float, **labels: str) -> None:
        key = (metric.name, tuple(sorted(labels.items())))
        previous = self._last.get(key, 0.0)
        if total < previous:  # the source restarted: count from its new zero
            previous = 0.0
        self._exporter.inc(metric, total - previous, **labels)
        self._last[key] = total
