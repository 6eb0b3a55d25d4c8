"""Everything one application's autoscaler needs, as plain JSON-able data.

Built from the manifest by the builder and handed to Ray Serve as the policy's `policy_kwargs`
(which must be JSON); rebuilt into the controller's typed config inside the Serve controller.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from autoscaler.observations import ControllerConfig, PoolLimits
from autoscaler.prometheus_source import PoolRef


@dataclass(frozen=True)
class PoolSettings:
    ref: PoolRef
    limits: PoolLimits
    initial_replicas: int


@dataclass(frozen=True)
class AutoscalerSettings:
    app: str  # Serve application name; one shared decision loop per application
    prometheus_url: str
    decision_interval_s: float
    metrics_window_s: float
    controller: ControllerConfig
    pools: tuple[PoolSettings, ...]

    def pool(self, name: str) -> PoolSettings:
        return next(pool for pool in self.pools if pool.ref.pool == name)

    def to_json(self) -> dict[str, Any]:
        controller = dataclasses.asdict(self.controller)
        if math.isinf(controller["budget_units"]):
            controller["budget_units"] = None  # JSON has no infinity
        return {
            "app": self.app, "prometheus_url": self.prometheus_url,
            "decision_interval_s": self.decision_interval_s, "metrics_window_s": self.metrics_window_s,
            "controller": controller,
            "pools": [{"ref": dataclasses.asdict(p.ref), "limits": dataclasses.asdict(p.limits),
                       "initial_replicas": p.initial_replicas} for p in self.pools],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AutoscalerSettings:
        controller = dict(data["controller"])
        if controller["budget_units"] is None:
            controller["budget_units"] = math.inf
        if controller.get("ratio_bounds") is not None:
            controller["ratio_bounds"] = tuple(controller["ratio_bounds"])
        pools = tuple(PoolSettings(PoolRef(**p["ref"]), PoolLimits(**p["limits"]), p["initial_replicas"])
                      for p in data["pools"])
        return cls(data["app"], data["prometheus_url"], data["decision_interval_s"], data["metrics_window_s"],
                   ControllerConfig(**controller), pools)


def settings_from_manifest(manifest: Any) -> AutoscalerSettings:
    """`manifest`: a cluster.manifest.Manifest whose pools all have autoscaling bounds."""
    spec = manifest.autoscaling
    gpu = manifest.accelerator.value == "gpu"
    pools = []
    for pool in manifest.pools:
        bounds = pool.autoscaling
        per_rank = pool.placement.num_gpus if gpu else pool.placement.num_cpus
        pools.append(PoolSettings(
            PoolRef(pool.name, pool.role.value, pool.ranks_per_replica),
            PoolLimits(pool.name, bounds.min_replicas, bounds.max_replicas,
                       units_per_replica=pool.ranks_per_replica * max(per_rank, 1e-9),
                       running_capacity_per_replica=bounds.running_capacity_per_replica),
            pool.replicas))
    controller = ControllerConfig(
        ttft_slo_s=manifest.slo.ttft_ms / 1e3, itl_slo_s=manifest.slo.itl_ms / 1e3,
        budget_units=spec.budget_units if spec.budget_units is not None else math.inf,
        ratio_bounds=tuple(spec.ratio_bounds) if spec.ratio_bounds and manifest.disaggregated else None,
        scale_out_cooldown_s=spec.scale_out_cooldown_s, scale_in_cooldown_s=spec.scale_in_cooldown_s,
        scale_in_calm_s=spec.scale_in_calm_s, stale_after_s=spec.stale_after_s, hysteresis=spec.hysteresis,
        max_step=spec.max_step, scale_to_zero_idle_s=spec.scale_to_zero_idle_s,
        forecast_horizon_s=spec.forecast_horizon_s)
    url = spec.prometheus_url or f"http://127.0.0.1:{manifest.observability.prometheus_port}"
    return AutoscalerSettings(manifest.name, url, spec.decision_interval_s, spec.metrics_window_s, controller,
                              tuple(pools))
