"""The SLO-driven, coordinated autoscaler: pure, deterministic, time only from `now_s`.

One decision is: check the inputs can be trusted (else hold every pool where it is), plan
each pool from its own signals (`pool_plan`), fit the plans together (`coordination`: wake
partners, prefill:decode ratio, shared budget), remember what changed (`pool_history`).

Holds (targets == current, held=True): observations None or empty (metrics unreachable), a
configured pool without an observation, or the metrics of a pool with ready replicas older
than stale_after_s. A pool without a ready replica (at zero, or all starting) has no engine to
export and is never stale: its wake-up reads the ingress's arrivals and queue. While held
nothing is remembered, so cooldowns and idle clocks resume from real measurements.
"""

from __future__ import annotations

from typing import Sequence

from autoscaler.arrival_trend import ArrivalTrend
from autoscaler.coordination import coordinate
from autoscaler.errors import AutoscalerConfigError
from autoscaler.observations import (NO_SAMPLES_AGE_S, ControllerConfig, Decision, PoolLimits, PoolObservation,
                                     ScalingDecisions, hold_all)
from autoscaler.pool_history import PoolHistory
from autoscaler.pool_plan import plan_pool


class CoordinatedController:
    def __init__(self, config: ControllerConfig, limits: Sequence[PoolLimits]):
        if not limits:
            raise AutoscalerConfigError("limits", limits, "no pools", "give one PoolLimits per pool")
        names = [limit.pool for limit in limits]
        if len(set(names)) != len(names):
            raise AutoscalerConfigError("limits", names, "duplicate pool names", "one PoolLimits per pool")
        self.config = config
        self.limits = {limit.pool: limit for limit in limits}
        self._history = {name: PoolHistory(arrivals=ArrivalTrend(config.trend_window_s)) for name in names}
        self._last_known: dict[str, int] = {name: limit.min_replicas for name, limit in self.limits.items()}
        self._decided: set[str] = set()  # pools this controller has set a target for

    def decide(self, observations: Sequence[PoolObservation] | None, now_s: float,
               serve_sizes: dict[str, int] | None = None) -> ScalingDecisions:
        """Targets for every configured pool. None or [] means the metrics are unreachable.
        `serve_sizes`: each pool's replica target as Serve reports it, known even when the metrics
        are not: a controller that has not decided a pool yet (first deploy, restarted Serve
        controller, redeploy) holds it there, never at its minimum."""
        for pool, size in (serve_sizes or {}).items():
            if pool in self._last_known and pool not in self._decided:
                self._last_known[pool] = size
        if not observations:
            return self.decide_unreachable(now_s, "no observations: metrics source unreachable")
        by_pool = self._index(observations)
        for obs in by_pool.values():
            self._last_known[obs.pool] = obs.replicas
        held = self._hold_reason(by_pool)
        if held is not None:
            return self.decide_unreachable(now_s, held)

        plans = []
        for name, obs in by_pool.items():
            self._history[name].arrivals.add(now_s, obs.arrival_rps)
            # Idle time counts only while the pool can serve: requests stuck behind starting
            # replicas may not show up in any metric yet, and cutting a replica mid-start wastes it.
            idle_for_s = self._history[name].observe_idle(obs.idle and obs.ready_replicas > 0, now_s)
            plans.append(plan_pool(obs, self.limits[name], self._history[name], self.config, now_s, idle_for_s))
        fitted = coordinate(plans, self.config.ratio_bounds, self.config.budget_units)

        decisions = []
        for plan in plans:
            target = fitted.targets[plan.pool]
            reason = "; ".join([plan.reason, *fitted.notes.get(plan.pool, [])])
            decisions.append(Decision(plan.pool, plan.current, target, reason))
            self._history[plan.pool].record(plan.current, target, now_s)
            # A hold before the next observation keeps this target: holding at the size observed
            # before it would undo the decision (and restart a replica just removed).
            self._last_known[plan.pool] = target
            self._decided.add(plan.pool)
        return ScalingDecisions(tuple(decisions), now_s)

    def decide_unreachable(self, now_s: float, reason: str) -> ScalingDecisions:
        """Hold every pool at its last known size: a blind controller must not move anything."""
        for history in self._history.values():
            history.forget_measurements()
        return hold_all(self._last_known.copy(), now_s, reason)

    def _hold_reason(self, by_pool: dict[str, PoolObservation]) -> str | None:
        missing = [name for name in self.limits if name not in by_pool]
        if missing:
            return f"no observation for pool(s) {', '.join(missing)}"
        stale = [obs for obs in by_pool.values()
                 if obs.ready_replicas > 0 and obs.metrics_age_s > self.config.stale_after_s]
        if stale:
            ages = ", ".join(f"{obs.pool} {_age(obs.metrics_age_s)}" for obs in stale)
            return f"stale metrics ({ages} > {self.config.stale_after_s:.0f}s)"
        return None

    def _index(self, observations: Sequence[PoolObservation]) -> dict[str, PoolObservation]:
        by_pool: dict[str, PoolObservation] = {}
        for obs in observations:
            if obs.pool not in self.limits:
                raise AutoscalerConfigError("observations", obs.pool, "pool has no PoolLimits",
                                            f"configure it, or drop it; known pools: {sorted(self.limits)}")
            by_pool[obs.pool] = obs
        # Configured order, so decisions (and replays) come out in a stable order.
        return {name: by_pool[name] for name in self.limits if name in by_pool}


def _age(seconds: float) -> str:
    return "no samples" if seconds >= NO_SAMPLES_AGE_S else f"{seconds:.0f}s"
