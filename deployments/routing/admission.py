"""Admission control: a bounded number of requests in flight per pool, and a fast 429 past it.

Rule: a request is admitted while fewer than `max_running + max_queued` are in flight (running
in the engines plus waiting for them) and, when `max_prompt_tokens` is set, while the prompt
tokens in flight plus its own stay within it: one 32k-token prompt is as much prefill and KV as
a hundred short ones, and a count of requests alone would take a hundred of it at once. A
request alone in the gate is admitted whatever its length (nothing else could make room). Priority classes share that bound unequally: class `p`
may only fill `share[p]` of the queue part (e.g. batch traffic gets half the queue, interactive
all of it), so under overload low priority is shed first. A rejected request is told when to
come back: Retry-After = the time the excess takes to drain at the recent completion rate,
clamped to [min_retry_s, max_retry_s]. Never blocks: the decision is O(1) and immediate.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdmissionLimits:
    max_running: int
    max_queued: int
    priority_queue_share: dict[str, float] = field(default_factory=lambda: {"high": 1.0, "normal": 1.0, "low": 0.5})
    min_retry_s: float = 1.0
    max_retry_s: float = 30.0
    rate_window_s: float = 30.0
    max_prompt_tokens: int | None = None  # None: requests are counted, not their tokens


@dataclass(frozen=True)
class Rejection:
    retry_after_s: int
    reason: str


class AdmissionGate:
    def __init__(self, limits: AdmissionLimits):
        if limits.max_running < 1 or limits.max_queued < 0:
            raise ValueError(f"admission needs max_running >= 1 and max_queued >= 0, got {limits}")
        if limits.max_prompt_tokens is not None and limits.max_prompt_tokens < 1:
            raise ValueError(f"admission needs max_prompt_tokens >= 1 (or None), got {limits.max_prompt_tokens}")
        self.limits = limits
        self.in_flight = 0
        self.prompt_tokens_in_flight = 0
        self.rejected_total = 0
        self._completions: deque[float] = deque()

    def admit(self, now_s: float, priority: str = "normal", prompt_tokens: int = 0) -> Rejection | None:
        """None: admitted (call `release` with the same `prompt_tokens` when it ends). Otherwise
        why not, and when to retry."""
        rejection = self.check(now_s, priority, prompt_tokens)
        if rejection is None:
            self.in_flight += 1
            self.prompt_tokens_in_flight += prompt_tokens
        return rejection

    def take(self, now_s: float, priority: str = "normal", prompt_tokens: int = 0) -> "Slot | Rejection":
        """`admit`, with the place as a Slot to give back (once) when the request ends."""
        rejection = self.admit(now_s, priority, prompt_tokens)
        return Slot(self, prompt_tokens) if rejection is None else rejection

    def check(self, now_s: float, priority: str = "normal", prompt_tokens: int = 0) -> Rejection | None:
        """What `admit` would answer now, without taking a place: lets a server refuse before it
        spends anything on the request (reading, parsing, tokenizing), then admit after."""
        share = self.limits.priority_queue_share.get(priority)
        if share is None:
            known = ", ".join(sorted(self.limits.priority_queue_share))
            raise ValueError(f"unknown priority {priority!r}; known: {known}")
        bound = self.limits.max_running + math.floor(share * self.limits.max_queued)
        if self.in_flight >= bound:
            self.rejected_total += 1
            excess = self.in_flight - bound + 1
            return Rejection(self._retry_after(excess, now_s),
                             f"{self.in_flight} requests in flight, the limit for priority {priority!r} is {bound}")
        token_bound = self.limits.max_prompt_tokens
        if token_bound is not None and self.in_flight and self.prompt_tokens_in_flight + prompt_tokens > token_bound:
            self.rejected_total += 1
            # Requests that must end to make room, at the average size of those in flight.
            average = self.prompt_tokens_in_flight / self.in_flight
            excess = math.ceil((self.prompt_tokens_in_flight + prompt_tokens - token_bound) / max(average, 1.0))
            return Rejection(self._retry_after(excess, now_s),
                             f"{self.prompt_tokens_in_flight} prompt tokens in flight and this request's "
                             f"{prompt_tokens} exceed the limit of {token_bound}")
        return None

    def release(self, now_s: float, prompt_tokens: int = 0) -> None:
        self.in_flight = max(self.in_flight - 1, 0)
        self.prompt_tokens_in_flight = max(self.prompt_tokens_in_flight - prompt_tokens, 0)
        self._completions.append(now_s)
        self._trim(now_s)

    def _retry_after(self, excess: int, now_s: float) -> int:
        self._trim(now_s)
        rate = len(self._completions) / self.limits.rate_window_s
        wait = excess / rate if rate > 0 else self.limits.max_retry_s
        return int(math.ceil(min(max(wait, self.limits.min_retry_s), self.limits.max_retry_s)))

    def _trim(self, now_s: float) -> None:
        while self._completions and now_s - self._completions[0] > self.limits.rate_window_s:
            self._completions.popleft()


class Slot:
    """One admitted request's place in the gate. Given back once: a request's end shows on more
    than one path (its last stream closing, an error before the response, the client leaving),
    and a place given back twice would let one request too many in."""

    def __init__(self, gate: AdmissionGate, prompt_tokens: int = 0):
        self._gate = gate
        self.prompt_tokens = prompt_tokens
        self.held = True

    def release(self, now_s: float) -> None:
        if self.held:
            self.held = False
            self._gate.release(now_s, self.prompt_tokens)
