"""Pending pool stores of one worker: bounded, aged, run one at a time on their own thread.

A finished request's blocks stay held until its store is done (kv_transfer.connector_worker),
so every pending store is engine KV waiting on the pool. A pool that is slow but not failing (a
congested segment answers within its deadline, so the breaker never opens) would hold ever more
of it, until the engine has no blocks left for new requests.

Rule: at most `max_pending` stores are queued or running. A store offered beyond that is shed at
once; a store that waited longer than `max_wait_s` is shed when its turn comes, or when a newer
store is offered behind it. Shed means its blocks are let go as if the store were done, and the
pool never gets them: the pool is a cache and can afford to lose writes, the engine cannot
afford to lose its KV. So a request's blocks are held at most about max_wait_s plus one store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable, Generic, TypeVar

logger = logging.getLogger(__name__)

_Job = TypeVar("_Job")


class StoreQueue(Generic[_Job]):
    """`run(job)` on this queue's thread, in order; `shed(job)` instead, on the caller's thread
    (full) or this queue's (too old). Both must let the job's blocks go; neither may block long."""

    def __init__(self, run: Callable[[_Job], None], shed: Callable[[_Job], None], max_pending: int,
                 max_wait_s: float, clock: Callable[[], float] = time.monotonic, name: str = "kv-pool-store"):
        self._run = run
        self._shed = shed
        self._max_pending = max_pending
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[tuple[_Job, float]] = deque()  # (job, queued at), oldest first
        self._running = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> bool:
        """Queue the job; False when it was shed instead (too many pending)."""
        now_s = self._clock()
        with self._cond:
            stale = self._take_stale(now_s)
            admitted = not self._closed and len(self._queue) + self._running < self._max_pending
            if admitted:
                self._queue.append((job, now_s))
                self._cond.notify()
        for old in stale:
            self._shed(old)
        if not admitted:
            self._shed(job)
        return admitted

    def pending(self) -> int:
        """Stores queued or running now."""
        with self._cond:
            return len(self._queue) + self._running

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """Stop the thread after the running store; queued stores are dropped with the engine
        (ThreadPoolExecutor's signature, which this queue replaced)."""
        with self._cond:
            self._closed = True
            if cancel_futures:
                self._queue.clear()
            self._cond.notify_all()
        if wait:
            self._thread.join()

    def _take_stale(self, now_s: float) -> list[_Job]:
        """Queued stores older than max_wait_s (the oldest are at the head). Under the lock."""
        stale = []
        while self._queue and now_s - self._queue[0][1] > self._max_wait_s:
            stale.append(self._queue.popleft()[0])
        return stale

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:  # closed and drained
                    return
                job, queued_at_s = self._queue.popleft()
                fresh = self._clock() - queued_at_s <= self._max_wait_s
                self._running = int(fresh)
            try:
                (self._run if fresh else self._shed)(job)
            except Exception:  # noqa: BLE001 - the thread must outlive a bug in one job
                logger.exception("kv pool: store job failed")
            finally:
                with self._cond:
                    self._running = 0
