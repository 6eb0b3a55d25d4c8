"""What the simulator measures the way Prometheus would: time-averaged gauges, trailing windows
of latency samples (p90), arrival counters. Cheap per update; the work happens per tick."""

from __future__ import annotations

from collections import deque

import numpy as np


class TimeAverage:
    """A gauge averaged over time between two `take` calls (like avg_over_time)."""

    __slots__ = ("value", "_last_s", "_area", "_since_s")

    def __init__(self, start_s: float = 0.0):
        self.value = 0.0
        self._last_s = start_s
        self._area = 0.0
        self._since_s = start_s

    def set(self, now_s: float, value: float) -> None:
        self._area += self.value * (now_s - self._last_s)
        self.value = value
        self._last_s = now_s

    def take(self, now_s: float) -> float:
        """Average since the previous take; starts a new interval."""
        self.set(now_s, self.value)
        span = now_s - self._since_s
        average = self._area / span if span > 0 else self.value
        self._area, self._since_s = 0.0, now_s
        return average


class SampleWindow:
    """Samples stamped with the time they were observed; p90 of the trailing window_s."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._times: deque[float] = deque()
        self._values: deque[float] = deque()

    def add(self, at_s: float, value: float) -> None:
        self._times.append(at_s)
        self._values.append(value)

    def _trim(self, now_s: float) -> None:
        cutoff = now_s - self.window_s
        while self._times and self._times[0] < cutoff:
            self._times.popleft()
            self._values.popleft()

    def p90(self, now_s: float) -> float | None:
        self._trim(now_s)
        if not self._values:
            return None
        return float(np.percentile(np.fromiter(self._values, float, len(self._values)), 90))

    def rate(self, now_s: float) -> float:
        """Samples per second over the window, or over the time so far while shorter (counters)."""
        self._trim(now_s)
        span = min(self.window_s, now_s)
        return len(self._times) / span if span > 0 else 0.0
