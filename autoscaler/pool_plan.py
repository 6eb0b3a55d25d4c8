"""One pool's wish, before the pools are coordinated: a target, the range it may move in, why.

Rule, in order (first match wins):
1. at zero: wake to max(1, min_replicas) as soon as requests arrive or wait (no cooldown);
   otherwise stay at min_replicas;
2. no ready replica yet (all starting): hold, there is nothing to measure (and nothing to
   call idle: requests waiting for the start may not show in any metric yet);
3. min_replicas == 0 and idle (nothing arriving, waiting or running) for scale_to_zero_idle_s,
   counted from the first ready replica: go to zero in one decision (nothing runs, so nothing
   is cut off);
4. pressure out > 1 (signals x arrival trend, see signals.py), and either clearly over
   (> 1 + h) or over in the previous decision too: scale out to sizing's scale_out_size.
   Sizes count *ready* replicas, so replicas still starting count as already ordered and a
   slow start does not order more;
5. calm (every signal < 1 - h), arrivals not rising (no trend growth beyond noise),
   for scale_in_calm_s on end: scale in to the largest scale_in_size wished in the last
   scale_in_calm_s (a sliding window; one replica at a time when the pool reports no
   utilisation), if that sheds at least h/2 of the replicas (smaller trims are noise);
6. otherwise hold (inside the band).
The wish is clamped to [lo, hi]: min/max replicas, max_step per decision, cooldowns.
More load never gives a smaller wish.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoscaler.observations import ControllerConfig, PoolLimits, PoolObservation
from autoscaler.pool_history import PoolHistory
from autoscaler.signals import pool_pressure
from autoscaler.sizing import QueueSample, scale_in_size, scale_out_size


@dataclass(frozen=True)
class PoolPlan:
    pool: str
    role: str
    current: int
    want: int  # already inside [lo, hi]
    lo: int  # lowest target allowed now (min_replicas, max_step, scale-in cooldown)
    hi: int  # highest target allowed now (max_replicas, max_step, scale-out cooldown)
    min_replicas: int  # the only floor a budget cut may not go below
    need: int  # replicas enough for today's utilisation (a budget donor keeps at least these)
    pressure: float  # relative SLO violation (1.0 at threshold): ranks pools for scarce budget
    ready: int
    units_per_replica: float
    reason: str
    waking: bool = False  # leaving zero: its partner must wake as well


def plan_pool(obs: PoolObservation, limits: PoolLimits, history: PoolHistory, config: ControllerConfig,
              now_s: float, idle_for_s: float) -> PoolPlan:
    """Also records in `history` what the next decision needs (calm stretch, queue sample)."""
    current, step = obs.replicas, config.max_step
    lo = max(limits.min_replicas, current - step) if history.cooled_down(now_s, config.scale_in_cooldown_s) \
        else max(limits.min_replicas, current)
    hi = min(limits.max_replicas, current + step) if history.cooled_down(now_s, config.scale_out_cooldown_s) \
        else min(limits.max_replicas, current)
    lo, hi = min(lo, limits.max_replicas), max(hi, limits.min_replicas)
    previous_queue, history.previous_queue = history.previous_queue, QueueSample(now_s, obs.queue_depth)

    def plan(want: int, reason: str, pressure: float = 0.0, need: int | None = None, *, lo: int = lo,
             hi: int = hi, waking: bool = False) -> PoolPlan:
        clamped = min(max(want, lo), hi)
        if clamped != want:
            reason += f"; {_clamp_note(want, clamped, limits, history, config, now_s)}"
        return PoolPlan(obs.pool, obs.role, current, clamped, lo, hi, limits.min_replicas,
                        current if need is None else max(need, limits.min_replicas), pressure,
                        obs.ready_replicas, limits.units_per_replica, reason, waking)

    if current == 0:
        if obs.has_demand:
            wake = min(max(1, limits.min_replicas), limits.max_replicas)
            return plan(wake, f"waking from zero: {_demand_text(obs)}", math.inf, lo=wake, hi=wake, waking=True)
        return plan(limits.min_replicas, "idle at zero" if limits.min_replicas == 0 else "raise to min_replicas")
    if obs.ready_replicas == 0:
        return plan(current, f"hold: all {current} replicas starting")
    if limits.min_replicas == 0 and idle_for_s >= config.scale_to_zero_idle_s:
        return plan(0, f"idle for {idle_for_s:.0f}s >= {config.scale_to_zero_idle_s:.0f}s: scale to zero", 0.0, 0,
                    lo=0)

    growth = history.arrivals.growth(config.forecast_horizon_s, config.max_forecast_growth, config.trend_noise)
    pressure = pool_pressure(obs, limits, config, growth)
    enough = scale_in_size(obs, pressure, config)  # for today's utilisation; None: unknown
    need = current if enough is None else enough
    was_over, history.was_over = history.was_over, pressure.out > 1.0
    if pressure.out > 1.0:
        history.end_calm()
        if pressure.out <= 1.0 + config.hysteresis and not was_over:
            return plan(current, f"hold: {pressure.summary(1.0)}; slightly over, waiting for a second look",
                        pressure.out, need)
        size = scale_out_size(obs, pressure, config, previous_queue, now_s)
        if size <= current:
            return plan(current, f"hold: {pressure.summary(1.0)}; covered by {obs.starting_replicas} "
                                 f"starting replicas", pressure.out)
        return plan(size, f"scale out: {pressure.summary(1.0)}", pressure.out, size)
    if not pressure.calm:
        history.end_calm()
        return plan(current, f"hold: within band, {pressure.summary()}", pressure.out, need)
    if growth > 1.0:
        history.end_calm()
        return plan(current, f"hold: calm but {pressure.summary()}", pressure.out, need)
    size = current - 1 if enough is None else enough
    calm_for_s, peak = history.observe_calm(max(size, 1), now_s, config.scale_in_calm_s)
    if peak >= current:
        return plan(current, f"hold: calm, {pressure.summary()}, but {current} replicas needed", pressure.out, need)
    if current - peak < current * config.hysteresis / 2.0:
        return plan(current, f"hold: calm, {pressure.summary()}, but {peak} of {current} replicas needed: "
                             f"too small a trim to be more than noise", pressure.out, need)
    if calm_for_s < config.scale_in_calm_s:
        return plan(current, f"hold: calm for {calm_for_s:.0f}s < {config.scale_in_calm_s:.0f}s, "
                             f"{pressure.summary()}", pressure.out, need)
    return plan(peak, f"scale in: calm for {calm_for_s:.0f}s, {pressure.summary()}", pressure.out, peak)


def _demand_text(obs: PoolObservation) -> str:
    return f"arrivals {obs.arrival_rps or 0.0:.2f} rps, queue {obs.queue_depth:.1f}"


def _clamp_note(want: int, got: int, limits: PoolLimits, history: PoolHistory, config: ControllerConfig,
                now_s: float) -> str:
    since = history.since_change_s(now_s)
    if got < want:
        if got >= limits.max_replicas:
            return f"capped at max_replicas {limits.max_replicas} (wanted {want})"
        if since < config.scale_out_cooldown_s:
            return f"scale-out cooling down ({since:.0f}s since last change < {config.scale_out_cooldown_s:.0f}s)"
        return f"max_step {config.max_step} (wanted {want})"
    if got <= limits.min_replicas:
        return f"floored at min_replicas {limits.min_replicas} (wanted {want})"
    if since < config.scale_in_cooldown_s:
        return f"scale-in cooling down ({since:.0f}s since last change < {config.scale_in_cooldown_s:.0f}s)"
    return f"max_step {config.max_step} (wanted {want})"
