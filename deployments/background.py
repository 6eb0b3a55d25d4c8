"""Work a server starts and does not wait for (a lease's release after its caller left, stopping
a broken group's ranks): held until it ends, since the event loop keeps only weak references to
tasks and an unreferenced one can be collected mid-flight, and its failure logged, not lost."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable


class Background:
    def __init__(self, logger: logging.Logger):
        self._logger = logger
        self._tasks: set[asyncio.Future] = set()

    def spawn(self, work: Awaitable, what: str) -> asyncio.Future:
        """Run (or keep running) `work`; `what` names it in the log if it fails."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._done(done, what))
        return task

    def _done(self, task: asyncio.Future, what: str) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._logger.warning("%s failed: %s: %s", what, type(task.exception()).__name__, task.exception())

    def __len__(self) -> int:
        return len(self._tasks)
