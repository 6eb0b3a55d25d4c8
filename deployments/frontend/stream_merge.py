"""Fan-in of one request's child streams (n > 1, batch prompts) into one stream of (child, item)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from deployments.records import EngineFailure


async def merged(children: list, streams: list[AsyncIterator]) -> AsyncIterator[tuple]:
    """(child, item) from every child's stream as items arrive; closing it closes them all."""
    if len(streams) == 1:  # the common case (n == 1, one prompt): no tasks, no queue
        try:
            async for item in streams[0]:
                yield children[0], item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    finished = object()

    async def pump(child: Any, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((child, item))
        except Exception as exc:  # one sequence failing ends the response with an error event
            await queue.put((child, EngineFailure(f"{type(exc).__name__}: {exc}")))
        finally:
            await stream.aclose()
            queue.put_nowait(finished)

    tasks = [asyncio.ensure_future(pump(c, s)) for c, s in zip(children, streams)]
    remaining = len(tasks)
    try:
        while remaining:
            got = await queue.get()
            if got is finished:
                remaining -= 1
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def ended_then(stream: AsyncIterator, on_end: Callable[[], None]) -> AsyncIterator:
    """`stream`, calling `on_end` once it has ended however it ends: exhausted, failed, closed or
    cancelled (`merged` ends only after every child stream has)."""
    try:
        async for item in stream:
            yield item
    finally:
        try:
            await stream.aclose()
        finally:
            on_end()
