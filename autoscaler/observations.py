"""What a scaling policy sees, the bounds it works in, and what it decides. Plain typed data.

A "replica" is whatever the pool adds or removes as one piece: one engine, or one whole
expert-parallel group of `ranks_per_replica` ranks (groups are never split). Costs are counted
in "units" (accelerators or nodes, the caller's choice): a replica costs `units_per_replica`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Mapping, Protocol, Sequence

from autoscaler.errors import AutoscalerConfigError

Role = Literal["prefill", "decode", "colocated"]
NO_SAMPLES_AGE_S = 1e9  # metrics_age_s of a pool without any sample: as stale as it gets
ROLES: tuple[str, ...] = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class PoolObservation:
    """One pool's metrics at decision time (latencies are p90 over the metrics window)."""

    pool: str
    role: Role
    replicas: int  # current target: ready plus still starting (draining ones excluded)
    ranks_per_replica: int = 1  # 1, or the expert-parallel group size
    ttft_p90_s: float | None = None  # None: no first token in the window
    itl_p90_s: float | None = None  # inter-token latency; None: no finished request in the window
    queue_depth: float = 0.0  # requests waiting for a replica of this pool (window average)
    running: float = 0.0  # requests being served by this pool (window average)
    kv_cache_usage: float | None = None  # 0..1, fullest view the pool reports
    kv_transfer_s: float | None = None  # p90 prefill->decode KV hop
    arrival_rps: float | None = None  # requests arriving at this pool; None: not measured
    metrics_age_s: float = 0.0  # age of the newest sample; large means stale
    starting_replicas: int = 0  # of `replicas`, those not serving yet (placing or loading)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise AutoscalerConfigError(f"{self.pool}.role", self.role, "unknown role", f"use one of {ROLES}")
        if self.replicas < 0 or not 0 <= self.starting_replicas <= self.replicas:
            raise AutoscalerConfigError(f"{self.pool}.replicas", (self.replicas, self.starting_replicas),
                                        "need 0 <= starting_replicas <= replicas",
                                        "count starting replicas among the current ones")
        if self.ranks_per_replica < 1:
            raise AutoscalerConfigError(f"{self.pool}.ranks_per_replica", self.ranks_per_replica,
                                        "must be >= 1", "use 1, or the expert-parallel group size")

    @property
    def ready_replicas(self) -> int:
        return self.replicas - self.starting_replicas

    @property
    def idle(self) -> bool:
        """Nothing arriving, waiting or running: the pool could go to zero."""
        return not (self.arrival_rps or 0.0) > 0.0 and self.queue_depth <= 0.0 and self.running <= 0.0

    @property
    def has_demand(self) -> bool:
        """Requests arrive or wait: a pool at zero must wake up."""
        return (self.arrival_rps or 0.0) > 0.0 or self.queue_depth > 0.0


@dataclass(frozen=True)
class PoolLimits:
    pool: str
    min_replicas: int = 1  # 0 allows scale to zero
    max_replicas: int = 1
    units_per_replica: float = 1.0  # ranks_per_replica * units one rank costs
    running_capacity_per_replica: float | None = None
    """Requests one replica serves at once (1 for one-prompt-at-a-time prefill, the engine's
    max_num_seqs for decode). None: size from latency and queue only."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise AutoscalerConfigError(f"{self.pool}.min_replicas/max_replicas",
                                        (self.min_replicas, self.max_replicas),
                                        "need 0 <= min_replicas <= max_replicas", "swap or fix the bounds")
        if not self.units_per_replica > 0:
            raise AutoscalerConfigError(f"{self.pool}.units_per_replica", self.units_per_replica,
                                        "must be > 0", "give what one replica (or group) costs")
        if self.running_capacity_per_replica is not None and not self.running_capacity_per_replica > 0:
            raise AutoscalerConfigError(f"{self.pool}.running_capacity_per_replica",
                                        self.running_capacity_per_replica, "must be > 0 or None",
                                        "use the engine's max_num_seqs (decode) or 1 (prefill)")

    @classmethod
    def for_group(cls, pool: str, *, ranks_per_replica: int, units_per_rank: float, min_replicas: int,
                  max_replicas: int, running_capacity_per_replica: float | None = None) -> PoolLimits:
        """Limits of an expert-parallel pool: one replica is a whole group of ranks."""
        return cls(pool, min_replicas, max_replicas, ranks_per_replica * units_per_rank,
                   running_capacity_per_replica)


@dataclass(frozen=True)
class ControllerConfig:
    ttft_slo_s: float
    itl_slo_s: float
    budget_units: float  # shared by all pools; math.inf for none
    ratio_bounds: tuple[float, float] | None = None  # prefill:decode replicas, when both pools exist
    scale_out_cooldown_s: float = 60.0  # after any change, before the next scale-out
    scale_in_cooldown_s: float = 300.0  # after any change, before the next scale-in (longer)
    scale_in_calm_s: float = 120.0  # a pool must be calm this long on end before it scales in
    stale_after_s: float = 60.0
    hysteresis: float = 0.2  # scale in only below (1 - h) of every threshold
    max_step: int = 4  # replicas (groups) added or removed per pool per decision
    scale_to_zero_idle_s: float = 600.0
    queue_per_replica_high: float = 2.0  # waiting requests per ready replica that mean "overloaded"
    running_high_fraction: float = 0.9  # of running capacity
    kv_usage_high: float = 0.9
    forecast_horizon_s: float = 0.0
    """Extrapolate a rising arrival rate this far ahead (about the replica start time); 0: off."""
    trend_window_s: float = 300.0  # arrival rates the trend is drawn from
    max_forecast_growth: float = 2.0
    trend_noise: float = 0.05  # forecast growth up to 1 + this is noise; above it, no scale-in
    backlog_drain_s: float = 300.0  # a scale-out for a backlog sizes to drain it within this
    prefill_queue_gate: float = 0.25
    """TTFT grows prefill only while at least this many prompts per ready prefill replica wait:
    otherwise the time goes elsewhere (long prompts, KV hop, decode admission)."""

    def __post_init__(self) -> None:
        checks = [
            ("ttft_slo_s", self.ttft_slo_s > 0, "a positive p90 target in seconds"),
            ("itl_slo_s", self.itl_slo_s > 0, "a positive p90 target in seconds"),
            ("budget_units", self.budget_units > 0, "a positive number of units, or math.inf"),
            ("hysteresis", 0 <= self.hysteresis < 1, "a fraction in [0, 1), e.g. 0.2"),
            ("max_step", self.max_step >= 1, "at least 1 replica per decision"),
            ("scale_in_cooldown_s", self.scale_in_cooldown_s >= self.scale_out_cooldown_s >= 0,
             "scale_in_cooldown_s >= scale_out_cooldown_s >= 0: scaling in is the riskier move"),
            ("stale_after_s", self.stale_after_s > 0, "a positive age in seconds"),
            ("scale_in_calm_s", self.scale_in_calm_s >= 0, "a non-negative duration in seconds"),
            ("queue_per_replica_high", self.queue_per_replica_high > 0, "a positive count"),
            ("running_high_fraction", 0 < self.running_high_fraction <= 1, "a fraction in (0, 1]"),
            ("kv_usage_high", 0 < self.kv_usage_high <= 1, "a fraction in (0, 1]"),
            ("forecast_horizon_s", self.forecast_horizon_s >= 0, "0 (off) or about the replica start time"),
            ("backlog_drain_s", self.backlog_drain_s > 0, "a positive duration in seconds, e.g. 300"),
            ("trend_window_s", self.trend_window_s > 0, "a positive window in seconds, e.g. 300"),
            ("max_forecast_growth", self.max_forecast_growth >= 1, "at least 1 (1 turns forecasting off)"),
            ("trend_noise", self.trend_noise >= 0, "a non-negative fraction, e.g. 0.05"),
        ]
        for name, ok, fix in checks:
            if not ok:
                raise AutoscalerConfigError(f"ControllerConfig.{name}", getattr(self, name), "out of range", fix)
        if self.ratio_bounds is not None:
            low, high = self.ratio_bounds
            if not 0 < low <= high < math.inf:
                raise AutoscalerConfigError("ControllerConfig.ratio_bounds", self.ratio_bounds,
                                            "need 0 < min <= max < inf", "e.g. (0.25, 4.0), or None")


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    target: int
    reason: str  # human-readable, e.g. "ttft p90 2.40s > SLO 2.00s, queue 12.0"

    @property
    def delta(self) -> int:
        return self.target - self.current


@dataclass(frozen=True)
class ScalingDecisions:
    decisions: tuple[Decision, ...]
    at_s: float
    held: bool = False  # True: every target equals current because the inputs cannot be trusted
    hold_reason: str | None = None

    def targets(self) -> dict[str, int]:
        return {decision.pool: decision.target for decision in self.decisions}

    def changed(self) -> tuple[Decision, ...]:
        return tuple(decision for decision in self.decisions if decision.delta != 0)


class ScalingPolicy(Protocol):
    """What the simulator and replay drive: `observations=None` means metrics are unreachable;
    `serve_sizes` (each pool's replica target as Serve reports it) is where a pool the policy has
    not sized yet is held."""

    def decide(self, observations: Sequence[PoolObservation] | None, now_s: float,
               serve_sizes: Mapping[str, int] | None = None) -> ScalingDecisions: ...


def hold_all(current: dict[str, int], now_s: float, reason: str) -> ScalingDecisions:
    """Targets equal to current for every known pool, each decision carrying the hold reason."""
    decisions = tuple(Decision(pool, replicas, replicas, f"held: {reason}") for pool, replicas in current.items())
    return ScalingDecisions(decisions, now_s, held=True, hold_reason=reason)
