"""What the controller remembers per pool between decisions: its last change, calm and idle
stretches, recent arrival rates, its last queue depth, and whether it was over a threshold.

Cooldown rule: after any change of a pool's target, the next scale-out waits
scale_out_cooldown_s and the next scale-in waits scale_in_cooldown_s (the longer one: removing
capacity is the riskier move, and adding it after a removal should be quick). So consecutive
changes, and therefore changes of direction, are at least scale_out_cooldown_s apart, and a
scale-in never follows any change within scale_in_cooldown_s.

Confirmation rule: a signal barely over its threshold (out <= 1 + hysteresis) scales out only
if the previous decision saw the pool over as well; one noisy sample does not add replicas.

Stabilisation rule (as Kubernetes' HPA scale-down window): a scale-in also needs the pool calm
for scale_in_calm_s on end, and goes only down to the most replicas any calm decision of the
last scale_in_calm_s wanted, so one quiet sample or a load still ramping up does not remove
capacity. The window slides: a wish from the tail of a load step ages out of it, whereas a peak
kept for the whole calm stretch would pin the pool at its size for as long as it stays calm.

Waking from zero and going to zero after scale_to_zero_idle_s are exempt from cooldowns: both
are driven by the arrival or absence of work, not by a noisy measure of how much.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from autoscaler.arrival_trend import ArrivalTrend
from autoscaler.sizing import QueueSample


@dataclass
class PoolHistory:
    last_change_s: float | None = None
    last_direction: int = 0  # +1 scaled out, -1 scaled in, 0 never changed
    idle_since_s: float | None = None
    calm_since_s: float | None = None  # start of the current calm stretch
    calm_wishes: deque[tuple[float, int]] = field(default_factory=deque)  # (at_s, replicas wanted), calm only
    arrivals: ArrivalTrend = field(default_factory=lambda: ArrivalTrend(300.0))
    previous_queue: QueueSample | None = None  # the last decision's queue, for its growth rate
    was_over: bool = False  # the previous decision saw a signal over its threshold

    def since_change_s(self, now_s: float) -> float:
        return float("inf") if self.last_change_s is None else now_s - self.last_change_s

    def cooled_down(self, now_s: float, cooldown_s: float) -> bool:
        return self.since_change_s(now_s) >= cooldown_s

    def observe_idle(self, idle: bool, now_s: float) -> float:
        """Records whether the pool is idle now; returns for how long it has been idle."""
        if not idle:
            self.idle_since_s = None
            return 0.0
        if self.idle_since_s is None:
            self.idle_since_s = now_s
        return now_s - self.idle_since_s

    def observe_calm(self, wanted_replicas: int, now_s: float, window_s: float) -> tuple[float, int]:
        """A calm decision wanting this many replicas: (calm for how long, the most replicas any
        calm decision of the last `window_s` wanted, this one included)."""
        if self.calm_since_s is None:
            self.calm_since_s = now_s
        self.calm_wishes.append((now_s, wanted_replicas))
        while self.calm_wishes[0][0] < now_s - window_s:
            self.calm_wishes.popleft()
        return now_s - self.calm_since_s, max(wanted for _at_s, wanted in self.calm_wishes)

    def end_calm(self) -> None:
        self.calm_since_s = None
        self.calm_wishes.clear()

    def forget_measurements(self) -> None:
        """After a hold: stretches of calm or idleness must be measured again, not assumed."""
        self.end_calm()
        self.idle_since_s = None
        self.previous_queue = None
        self.was_over = False

    def record(self, current: int, target: int, now_s: float) -> None:
        if target != current:
            self.last_change_s = now_s
            self.last_direction = 1 if target > current else -1
            self.end_calm()  # a new size: its calm stretch starts over
