"""The Ray Serve actuator: a custom autoscaling policy that asks the application's shared loop.

Serve instantiates `CoordinatedPoolPolicy` once per deployment (pool) in its controller process
and calls it on every control-loop tick with that deployment's AutoscalingContext. The call only
reports Serve's replica counts to the application's DecisionLoop and returns the loop's latest
target, so it costs microseconds; the observing and deciding happen on the loop's own thread.

Why deployment-level policies sharing one loop rather than Ray Serve's application-level
policy: Ray 2.60 registers an application-level policy only from a config-file deploy
(`serve deploy` / the REST API), and moe-serve deploys with `serve.run` from a built
application. Serve also pickles this module by value; the shared state therefore lives in
autoscaler/serve_loop.py, which is imported normally.

Serve's own damping is switched off by the builder (zero delays, factor 1): cooldowns and
hysteresis are the controller's. Serve keeps two behaviours of its own: min/max bounds, and a
pool at zero replicas starting one at once when a request waits (its cold-start path), while
the request waits at the handle instead of failing.
"""

from __future__ import annotations

import json
from typing import Any


class CoordinatedPoolPolicy:
    def __init__(self, settings: dict, record_path: str | None = None):
        """`settings`: AutoscalerSettings.to_json(); the same for every pool of the application."""
        self._settings = settings
        self._record_path = record_path
        self._loop = None

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        loop = self._shared_loop()
        target = loop.report(ctx.deployment_name, int(ctx.target_num_replicas), int(ctx.current_num_replicas))
        return target, ctx.policy_state

    def _shared_loop(self):
        if self._loop is not None and self._loop.running:
            return self._loop
        from autoscaler import serve_loop

        key = json.dumps([self._settings, self._record_path], sort_keys=True)
        self._loop = serve_loop.shared_loop(key, lambda: _build_loop(self._settings, self._record_path))
        return self._loop


def _build_loop(settings_json: dict, record_path: str | None):
    from autoscaler.prometheus_source import PrometheusSource
    from autoscaler.serve_loop import AutoscalerMetrics, DecisionLoop
    from autoscaler.settings import AutoscalerSettings
    from monitoring.exporter import MetricsExporter
    from monitoring.prometheus_api import PrometheusAPI

    settings = AutoscalerSettings.from_json(settings_json)
    # A loaded Prometheus may take seconds to answer; a hung one delays only this loop's next
    # decision (Serve keeps getting the previous targets meanwhile).
    api = PrometheusAPI(settings.prometheus_url, timeout_s=max(5.0, settings.decision_interval_s))
    source = PrometheusSource(api, [pool.ref for pool in settings.pools], window=f"{settings.metrics_window_s:g}s")
    return DecisionLoop(settings, source, metrics=AutoscalerMetrics(MetricsExporter()), record_path=record_path)
