"""Seeded request traces for the simulator: steady, diurnal, bursty and shift.

Arrivals are a Poisson process whose rate may vary in time (sampled by thinning: candidates at
the peak rate, each kept with probability rate(t) / peak). Lengths are uniform integers in
[mean * (1 - spread), mean * (1 + spread)], at least 1. The same arguments (seed included)
always give the same trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Lengths:
    mean_tokens: int
    spread: float = 0.5  # half-width as a fraction of the mean, in [0, 1]

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        low = max(1, round(self.mean_tokens * (1 - self.spread)))
        high = max(low, round(self.mean_tokens * (1 + self.spread)))
        return rng.integers(low, high + 1, size=count, dtype=np.int64)


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    arrival_s: np.ndarray  # float64, sorted
    prompt_tokens: np.ndarray  # int64
    output_tokens: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def mean_rps(self) -> float:
        return len(self) / self.duration_s


def _arrivals(rng: np.random.Generator, duration_s: float, peak_rps: float,
              rate_at: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    if peak_rps <= 0:
        return np.zeros(0)
    count = rng.poisson(peak_rps * duration_s)
    candidates = np.sort(rng.uniform(0.0, duration_s, size=count))
    keep = rng.uniform(0.0, peak_rps, size=count) < rate_at(candidates)
    return candidates[keep]


def _trace(name: str, seed: int, duration_s: float, peak_rps: float, rate_at: Callable[[np.ndarray], np.ndarray],
           prompt: Lengths, output: Lengths) -> Trace:
    rng = np.random.default_rng(seed)
    arrival_s = _arrivals(rng, duration_s, peak_rps, rate_at)
    return Trace(name, duration_s, arrival_s, prompt.sample(rng, len(arrival_s)), output.sample(rng, len(arrival_s)))


def steady(duration_s: float, rate_rps: float, prompt: Lengths, output: Lengths, seed: int = 0) -> Trace:
    return _trace("steady", seed, duration_s, rate_rps, lambda t: np.full_like(t, rate_rps), prompt, output)


def diurnal(duration_s: float, mean_rps: float, prompt: Lengths, output: Lengths, amplitude: float = 0.6,
            period_s: float | None = None, seed: int = 0) -> Trace:
    """rate(t) = mean * (1 - amplitude * cos(2 pi t / period)): starts at the trough, peaks mid-period.
    One period spans the trace unless given (a day compressed into the simulated time)."""
    period = period_s or duration_s

    def rate_at(t: np.ndarray) -> np.ndarray:
        return mean_rps * (1.0 - amplitude * np.cos(2.0 * math.pi * t / period))

    return _trace("diurnal", seed, duration_s, mean_rps * (1.0 + amplitude), rate_at, prompt, output)


def bursty(duration_s: float, base_rps: float, burst_rps: float, prompt: Lengths, output: Lengths,
           mean_burst_s: float = 60.0, mean_gap_s: float = 300.0, seed: int = 0) -> Trace:
    """base_rps, with bursts at burst_rps; burst and gap lengths are exponential (seeded)."""
    rng = np.random.default_rng(seed + 1_000_003)  # its own stream: the schedule, not the requests
    edges, t, on = [], 0.0, False
    while t < duration_s:
        t += rng.exponential(mean_burst_s if on else mean_gap_s)
        edges.append(t)
        on = not on
    edges_array = np.array(edges)

    def rate_at(times: np.ndarray) -> np.ndarray:
        in_burst = np.searchsorted(edges_array, times, side="right") % 2 == 1
        return np.where(in_burst, burst_rps, base_rps)

    return _trace("bursty", seed, duration_s, max(base_rps, burst_rps), rate_at, prompt, output)


def shift(duration_s: float, rate_rps: float, prompt_before: Lengths, prompt_after: Lengths, output: Lengths,
          shift_at_fraction: float = 0.5, seed: int = 0) -> Trace:
    """Same rate throughout; prompts switch from prompt_before to prompt_after at the shift."""
    base = steady(duration_s, rate_rps, prompt_before, output, seed)
    rng = np.random.default_rng(seed + 2_000_003)
    after = base.arrival_s >= shift_at_fraction * duration_s
    prompts = base.prompt_tokens.copy()
    prompts[after] = prompt_after.sample(rng, int(after.sum()))
    return Trace("shift", duration_s, base.arrival_s, prompts, base.output_tokens)
