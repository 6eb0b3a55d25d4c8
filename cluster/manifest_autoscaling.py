"""The manifest's autoscaling sections: per-pool bounds and the controller's settings.

A pool scales when it has `autoscaling: {min_replicas, max_replicas}`; then `replicas` is the
size it starts with. The controller decides for all pools together (prefill:decode ratio,
shared budget), so either every pool has bounds or none has. The top-level `autoscaling`
section tunes the controller; its defaults suit GPU clusters (replicas take minutes to start),
the local manifests shorten them. Checks across fields (min <= max, cooldown order) run from the
manifest's own validation, so errors can name the pool's index.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from cluster.errors import ManifestIssue


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class PoolAutoscalingSpec(_Strict):
    min_replicas: Annotated[int, Field(ge=0, le=10_000)] = 1
    """Fewest replicas (expert-parallel pools: groups). 0 lets an idle pool scale to zero; the
    first request then waits at the ingress until a replica is up."""
    max_replicas: Annotated[int, Field(ge=1, le=10_000)] = 1
    """Most replicas (groups); also bounded by the cluster's budget."""
    running_capacity_per_replica: Annotated[float, Field(gt=0)] | None = None
    """Requests one replica serves well at once; running above 90% of it means "add a replica".
    Unset: scale on latency and queue alone."""


class AutoscalingSpec(_Strict):
    """How the coordinated autoscaler decides (see autoscaler/observations.py ControllerConfig)."""

    prometheus_url: str | None = None
    """Prometheus the autoscaler reads. Unset: the local one `moe-serve up` starts
    (http://127.0.0.1:<observability.prometheus_port>)."""
    decision_interval_s: Annotated[float, Field(ge=0.5, le=600)] = 10.0
    """How often the controller decides for all pools."""
    metrics_window_s: Annotated[float, Field(ge=5, le=3600)] = 120.0
    """Window of the latency percentiles and rates it reads (several scrape intervals)."""
    scale_out_cooldown_s: Annotated[float, Field(ge=0)] = 60.0
    """After any change of a pool, wait this long before adding to it."""
    scale_in_cooldown_s: Annotated[float, Field(ge=0)] = 300.0
    """After any change of a pool, wait this long before removing from it (>= scale-out's)."""
    scale_in_calm_s: Annotated[float, Field(ge=0)] = 120.0
    """A pool must be calm (every signal under its threshold by the hysteresis) this long before a
    scale-in, which goes down to the most replicas any decision of the last scale_in_calm_s wanted."""
    stale_after_s: Annotated[float, Field(gt=0)] = 60.0
    """Metrics older than this make the controller hold every pool where it is."""
    hysteresis: Annotated[float, Field(ge=0, lt=1)] = 0.2
    """Scale in only below (1 - hysteresis) of every threshold."""
    max_step: Annotated[int, Field(ge=1)] = 4
    """Replicas (groups) added or removed per pool per decision."""
    scale_to_zero_idle_s: Annotated[float, Field(ge=0)] = 600.0
    """A pool with min_replicas 0 goes to zero after this long without any request."""
    ratio_bounds: tuple[Annotated[float, Field(gt=0)], Annotated[float, Field(gt=0)]] | None = (0.25, 4.0)
    """Allowed prefill:decode replica ratio [low, high] (disaggregated manifests); null: free."""
    budget_units: Annotated[float, Field(gt=0)] | None = None
    """Most accelerators (cpu manifests: CPUs) all pools may hold together; null: no limit."""
    forecast_horizon_s: Annotated[float, Field(ge=0)] = 0.0
    """Extrapolate a rising arrival rate this far ahead (about a replica's start time); 0: off."""
    record_path: str | None = None
    """Write the controller's inputs and decisions to this file (on the head node) as a replay
    case for autoscaler/replay.py; unset: keep them in memory only."""


def autoscaling_issues(manifest: Any) -> list[ManifestIssue]:
    """Checks across fields and pools; `manifest` is a cluster.manifest.Manifest."""
    if not manifest.autoscaled:
        return []
    problems = []
    for index, pool in enumerate(manifest.pools):
        bounds = pool.autoscaling
        if bounds is None:
            problems.append(ManifestIssue(
                f"pools[{index}].autoscaling", None, "other pools autoscale and this one does not: the "
                "autoscaler decides for all pools together", "add autoscaling: {min_replicas: N, max_replicas: "
                "N} (equal bounds pin the pool at N), or remove autoscaling from every pool"))
        elif bounds.min_replicas > bounds.max_replicas:
            problems.append(ManifestIssue(
                f"pools[{index}].autoscaling.min_replicas", bounds.min_replicas,
                f"greater than max_replicas={bounds.max_replicas}", "swap them or raise max_replicas"))
        elif not bounds.min_replicas <= pool.replicas <= bounds.max_replicas:
            problems.append(ManifestIssue(
                f"pools[{index}].replicas", pool.replicas,
                f"outside autoscaling bounds [{bounds.min_replicas}, {bounds.max_replicas}]",
                "start within the bounds: set replicas between min_replicas and max_replicas"))
    if not manifest.observability.metrics:
        problems.append(ManifestIssue(
            "observability.metrics", False, "the autoscaler reads the pools' metrics from Prometheus",
            "set observability.metrics: true, or remove autoscaling from the pools"))
    spec = manifest.autoscaling
    if spec.scale_in_cooldown_s < spec.scale_out_cooldown_s:
        problems.append(ManifestIssue(
            "autoscaling.scale_in_cooldown_s", spec.scale_in_cooldown_s,
            f"shorter than scale_out_cooldown_s={spec.scale_out_cooldown_s:g}",
            "scaling in is the riskier move: make its cooldown at least as long"))
    if spec.ratio_bounds is not None and spec.ratio_bounds[0] > spec.ratio_bounds[1]:
        problems.append(ManifestIssue(
            "autoscaling.ratio_bounds", list(spec.ratio_bounds), "low > high", "write [low, high], e.g. [0.25, 4]"))
    if spec.stale_after_s < 2 * spec.decision_interval_s:
        problems.append(ManifestIssue(
            "autoscaling.stale_after_s", spec.stale_after_s,
            f"under 2 x decision_interval_s={spec.decision_interval_s:g}: every decision would see stale metrics",
            "make stale_after_s at least twice the decision interval (and several scrape intervals)"))
    return problems
