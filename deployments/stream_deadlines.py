"""Bounded waits of the request path: the prefill, the first token, each next token, the total.

Rule for a token stream: it must deliver its first token within first_token_timeout_s of its
start (grown by prefill_s_per_1k_tokens for each thousand prompt tokens: a 32k-token prompt
takes tens of times a short one's prefill, and its KV as many times the bytes to move); after that every item within inter_token_timeout_s of the previous one; and, when
total_timeout_s is set, everything within that of the start. The earliest bound that applies
is the one that fires. `StreamDeadlines` is that rule as pure logic (times in, decisions out);
`bounded` applies it to a stream: on expiry it cancels the pending read (for a Serve handle's
stream that cancels the remote call, and the engine server aborts the request, freeing its KV
blocks and lease), closes the stream and ends it with a WaitExpired value instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from deployments.records import WaitExpired

# wait -> (what the request was waiting for, the manifest field that bounds it)
WAITS = {
    "prefill": ("the prefill pool's result", "prefill_timeout_s"),
    "first_token": ("the first token", "first_token_timeout_s"),
    "inter_token": ("the next token", "inter_token_timeout_s"),
    "total": ("the rest of the response", "total_timeout_s"),
}


@dataclass(frozen=True)
class RequestTimeouts:
    """The manifest's effective request_timeouts (cluster.manifest_timeouts.effective_timeouts)."""

    prefill_timeout_s: float
    first_token_timeout_s: float
    inter_token_timeout_s: float
    total_timeout_s: float | None = None
    # Added to the prefill and first-token bounds per thousand prompt tokens (`for_prompt`).
    prefill_s_per_1k_tokens: float = 0.0

    @classmethod
    def of(cls, values: dict[str, float] | None) -> "RequestTimeouts":
        """From the builder's dict; None: the CPU defaults (deployments built outside the builder)."""
        if values is None:
            from cluster.manifest_timeouts import DEFAULTS

            values = DEFAULTS["cpu"]
        return cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})

    def for_prompt(self, num_tokens: int) -> "RequestTimeouts":
        """These bounds for one request of `num_tokens` prompt tokens: the waits that include
        its prefill (and KV transfer) grow with its length; the gap between tokens does not."""
        extra_s = self.prefill_s_per_1k_tokens * max(num_tokens, 0) / 1000.0
        if extra_s == 0.0:
            return self
        return replace(self, prefill_timeout_s=self.prefill_timeout_s + extra_s,
                       first_token_timeout_s=self.first_token_timeout_s + extra_s)

    def limit_s(self, wait: str) -> float:
        return float(getattr(self, WAITS[wait][1]))


def wait_expired(wait: str, limit_s: float) -> WaitExpired:
    what, field = WAITS[wait]
    return WaitExpired(f"timed out after {limit_s:g} s waiting for {what}; the request was aborted. If the "
                       f"engines are this slow, raise request_timeouts.{field} in the manifest",
                       retriable=True, wait=wait, limit_s=limit_s)


@dataclass
class StreamDeadlines:
    """Which wait a token stream is in, and when it expires (monotonic seconds)."""

    timeouts: RequestTimeouts
    started_s: float
    last_item_s: float | None = None  # None until the first token (or the end) arrived

    def next(self) -> tuple[float, str]:
        """(deadline_s, wait) of the earliest bound that applies now."""
        t = self.timeouts
        if self.last_item_s is None:
            bounds = [(self.started_s + t.first_token_timeout_s, "first_token")]
        else:
            bounds = [(self.last_item_s + t.inter_token_timeout_s, "inter_token")]
        if t.total_timeout_s is not None:
            bounds.append((self.started_s + t.total_timeout_s, "total"))
        return min(bounds)

    def seen(self, item: Any, now_s: float) -> None:
        """An item arrived. Before the first token only a token or the stream's end counts (an
        empty delta does not end the first-token wait); after it every item restarts the gap."""
        if self.last_item_s is not None or getattr(item, "token_ids", None) or getattr(item, "finish_reason", None):
            self.last_item_s = now_s

    def expired(self) -> WaitExpired:
        _, wait = self.next()
        return wait_expired(wait, self.timeouts.limit_s(wait))


async def bounded(stream: AsyncIterator[Any], timeouts: RequestTimeouts,
                  clock: Callable[[], float] = time.monotonic) -> AsyncIterator[Any]:
    """`stream`'s items, ended by a WaitExpired value (the stream closed) when a bound expires."""
    deadlines = StreamDeadlines(timeouts, clock())
    items = stream.__aiter__()
    try:
        while True:
            deadline_s, _ = deadlines.next()
            try:
                item = await asyncio.wait_for(anext(items), max(deadline_s - clock(), 0.0))
            except StopAsyncIteration:
                return
            except TimeoutError:  # wait_for cancelled the read: the stream's own clean-up ran
                yield deadlines.expired()
                return
            deadlines.seen(item, clock())
            yield item
    finally:
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()


async def result_within(task: asyncio.Future[Any], timeout_s: float) -> bool:
    """Wait for `task` at most `timeout_s` without cancelling it; whether it is done."""
    done, _ = await asyncio.wait({task}, timeout=max(timeout_s, 0.0))
    return bool(done)
