"""A pool's recent arrival rates, extrapolated over the time a new replica needs to start.

Rule: fit a straight line (least squares) to the arrival rates of the trend window; the load
expected `horizon_s` from now, relative to the fitted rate now, is
    growth = 1 + slope * horizon_s / fitted_now,       clamped to [1, max_growth],
and growth up to 1 + noise is treated as noise (1). Only growth counts (a falling rate is left to
the calm stretch of a scale-in), and only once the window is at least half full.
"""

from __future__ import annotations

from collections import deque


class ArrivalTrend:
    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()  # (at_s, arrival_rps)

    def add(self, now_s: float, arrival_rps: float | None) -> None:
        if arrival_rps is None:
            return
        self._samples.append((now_s, arrival_rps))
        while self._samples and self._samples[0][0] < now_s - self.window_s:
            self._samples.popleft()

    def growth(self, horizon_s: float, max_growth: float, noise: float) -> float:
        samples = self._samples
        if horizon_s <= 0 or len(samples) < 3 or samples[-1][0] - samples[0][0] < self.window_s / 2:
            return 1.0
        n = len(samples)
        mean_t = sum(t for t, _ in samples) / n
        mean_r = sum(r for _, r in samples) / n
        spread = sum((t - mean_t) ** 2 for t, _ in samples)
        slope = sum((t - mean_t) * (r - mean_r) for t, r in samples) / spread
        fitted_now = mean_r + slope * (samples[-1][0] - mean_t)
        if fitted_now <= 0:
            return 1.0
        growth = min(max(1.0 + slope * horizon_s / fitted_now, 1.0), max_growth)
        return growth if growth > 1.0 + noise else 1.0
