"""Coalesce a fast stream of deltas into fewer, larger ones.

Every item streamed between Serve replicas costs a Ray object and Python work on both sides.
At high concurrency the engine emits one delta per request per step, and on few cores that
per-item cost competes with the model itself. Rule: the first delta goes out at once (TTFT is
untouched); after that, deltas that arrive within `interval_s` of the last send are merged and
sent together, and a finished delta is sent immediately. interval_s = 0 disables coalescing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")

_END = object()


async def coalesce(source: AsyncIterator[T], interval_s: float, merge: Callable[[T, T], T],
                   is_final: Callable[[T], bool]) -> AsyncIterator[T]:
    if interval_s <= 0:
        async for item in source:
            yield item
        return

    queue: asyncio.Queue = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in source:
                queue.put_nowait(item)
            queue.put_nowait(_END)
        except BaseException as exc:  # hand errors (and cancellation) to the consumer
            queue.put_nowait(exc)
            raise

    pump_task = asyncio.create_task(pump())
    last_sent_s: float | None = None
    try:
        while True:
            item = await queue.get()  # nothing pending: block without a deadline
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            if last_sent_s is not None and not is_final(item):
                wait_s = last_sent_s + interval_s - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)  # let more deltas gather behind this one
            pending, tail = item, None
            while not is_final(pending) and not queue.empty():
                nxt = queue.get_nowait()
                if nxt is _END or isinstance(nxt, BaseException):
                    tail = nxt
                    break
                pending = merge(pending, nxt)
            yield pending
            last_sent_s = time.monotonic()
            if is_final(pending) or tail is _END:
                return
            if tail is not None:
                raise tail
    finally:
        pump_task.cancel()
        try:
            await pump_task
        except BaseException:  # the pump's own cancellation or error, already handled above
            pass
