"""When to use the pool: a small circuit breaker, pure (time comes in as `now_s`).

Rule: the pool is used until a call to it fails; then it is skipped for `retry_after_s` (the
engine serves by recomputing, which is always correct), after which the next call tries it
again. One success closes the breaker. This bounds what a dead or hanging pool costs: one
failed call per `retry_after_s` per engine, instead of one per request or per step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolHealth:
    retry_after_s: float
    down_since_s: float | None = None
    failures_total: int = 0
    last_error: str = ""

    def usable(self, now_s: float) -> bool:
        return self.down_since_s is None or now_s - self.down_since_s >= self.retry_after_s

    def failed(self, now_s: float, error: str) -> None:
        self.failures_total += 1
        self.last_error = error
        self.down_since_s = now_s

    def succeeded(self) -> None:
        self.down_since_s = None

    @property
    def up(self) -> bool:
        return self.down_since_s is None
