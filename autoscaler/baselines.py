"""Two policies to compare the coordinated controller with, behind the same `decide` interface.

- FixedSplit: never changes any pool (a hand-picked prefill:decode split, sized once).
- QueueLengthPerPool: Ray Serve's default autoscaling rule applied to each pool on its own
  (`ray/serve/autoscaling_policy.py`, replica_queue_length_autoscaling_policy):
      desired = ceil((running + queue) / target_ongoing_requests_per_replica)
  clamped to [min_replicas, max_replicas]; a move happens only after the same direction was
  wanted continuously for upscale_delay_s (30 s) or downscale_delay_s (600 s), Ray's defaults;
  a pool at zero with requests waiting goes to 1 at once. No SLO, no coordination between pools,
  no shared budget (the cluster decides what actually gets placed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from autoscaler.errors import AutoscalerConfigError
from autoscaler.observations import Decision, PoolLimits, PoolObservation, ScalingDecisions, hold_all


class FixedSplit:
    def __init__(self) -> None:
        self._last_known: dict[str, int] = {}

    def decide(self, observations: Sequence[PoolObservation] | None, now_s: float,
               serve_sizes: Mapping[str, int] | None = None) -> ScalingDecisions:
        if not observations:  # blind: hold; a pool never observed holds at Serve's size
            return hold_all({**(serve_sizes or {}), **self._last_known}, now_s,
                            "no observations: metrics source unreachable")
        self._last_known = {obs.pool: obs.replicas for obs in observations}
        return ScalingDecisions(tuple(Decision(obs.pool, obs.replicas, obs.replicas, "fixed split: never scales")
                                      for obs in observations), now_s)


@dataclass
class _Pending:
    direction: int = 0  # +1 wants up, -1 wants down, 0 content
    since_s: float | None = None


class QueueLengthPerPool:
    def __init__(self, limits: Sequence[PoolLimits], target_ongoing_requests: Mapping[str, float],
                 upscale_delay_s: float = 30.0, downscale_delay_s: float = 600.0):
        self.limits = {limit.pool: limit for limit in limits}
        missing = sorted(set(self.limits) - set(target_ongoing_requests))
        if missing or any(value <= 0 for value in target_ongoing_requests.values()):
            raise AutoscalerConfigError("target_ongoing_requests", dict(target_ongoing_requests),
                                        f"need a positive target for every pool (missing {missing})",
                                        "give requests per replica, e.g. 1 for prefill, ~0.7 * max_num_seqs for decode")
        self.target_ongoing_requests = dict(target_ongoing_requests)
        self.upscale_delay_s = upscale_delay_s
        self.downscale_delay_s = downscale_delay_s
        self._pending = {name: _Pending() for name in self.limits}
        self._last_known: dict[str, int] = {}

    def decide(self, observations: Sequence[PoolObservation] | None, now_s: float,
               serve_sizes: Mapping[str, int] | None = None) -> ScalingDecisions:
        if not observations:  # blind: hold; a pool never observed holds at Serve's size
            return hold_all({**(serve_sizes or {}), **self._last_known}, now_s,
                            "no observations: metrics source unreachable")
        decisions = []
        for obs in observations:
            limits = self.limits[obs.pool]
            ongoing = obs.running + obs.queue_depth
            desired = math.ceil(ongoing / self.target_ongoing_requests[obs.pool] - 1e-9)
            desired = min(max(desired, limits.min_replicas), limits.max_replicas)
            target, why = self._delay(obs, desired, now_s)
            decisions.append(Decision(obs.pool, obs.replicas, target,
                                      f"ongoing {ongoing:.1f} / target "
                                      f"{self.target_ongoing_requests[obs.pool]:g} -> {desired}: {why}"))
            self._last_known[obs.pool] = obs.replicas
        return ScalingDecisions(tuple(decisions), now_s)

    def _delay(self, obs: PoolObservation, desired: int, now_s: float) -> tuple[int, str]:
        pending, current = self._pending[obs.pool], obs.replicas
        if current == 0 and desired > 0:
            self._pending[obs.pool] = _Pending()
            return max(1, desired), "cold start"
        if obs.ready_replicas == 0 and current > 0:
            return current, "no running replica to measure"
        direction = (desired > current) - (desired < current)
        if direction == 0:
            self._pending[obs.pool] = _Pending()
            return current, "at desired"
        if pending.direction != direction:
            pending.direction, pending.since_s = direction, now_s
        delay_s = self.upscale_delay_s if direction > 0 else self.downscale_delay_s
        waited_s = now_s - (pending.since_s if pending.since_s is not None else now_s)
        if waited_s + 1e-6 >= delay_s:
            self._pending[obs.pool] = _Pending()
            return desired, f"wanted for {waited_s:.0f}s >= {delay_s:.0f}s"
        return current, f"waiting ({waited_s:.0f}s of {delay_s:.0f}s)"
