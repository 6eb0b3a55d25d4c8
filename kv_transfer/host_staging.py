"""Reused host buffers for the KV copies between an engine's cache and the transports.

Fresh host memory costs a page fault per 4 KiB on first touch: gathering 67 MB of blocks into a
new buffer took 55 ms on this 2-core machine, into a reused one 6.6 ms (a plain copy: ~6 ms).
So staging buffers are kept and handed out again, by power-of-two size class, up to a bound on
the bytes kept. On CUDA they are pinned (torch's host allocator caches pinned memory as well; the
pool spares it the bookkeeping). A buffer comes back explicitly (`lease` as a context) or, for
pages handed to a transport server, when the last view of it is gone (`views_until_dropped`).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

MIN_CLASS_BYTES = 1 << 20
MAX_KEPT_BYTES = 512 << 20  # per engine worker; a transfer larger than this is staged unpooled
ARENA_ALIGN = 4096  # RegisteredStaging's ranges start on page boundaries


class _Staging:
    """What both kinds of staging hand out: `take` / `give_back`, plus these two on top."""

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        raise NotImplementedError

    def give_back(self, staged: torch.Tensor) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def lease(self, shape: tuple[int, ...]) -> Iterator[torch.Tensor]:
        staged = self.take(shape)
        try:
            yield staged
        finally:
            self.give_back(staged)

    def views_until_dropped(self, staged: torch.Tensor) -> memoryview:
        """A byte view of `staged`; the buffer comes back once that view and every slice of it
        are gone (a transport server drops the pages it sent)."""
        array = staged.numpy()
        weakref.finalize(array, self.give_back, staged)  # runs when the last view lets go of it
        return memoryview(array).cast("B")


class HostStaging(_Staging):
    def __init__(self, pinned: bool, max_kept_bytes: int = MAX_KEPT_BYTES):
        self._pinned = pinned
        self._max_kept = max_kept_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept_bytes = 0

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A uint8 tensor of `shape` (contents undefined), from a kept buffer when one fits."""
        nbytes = 1
        for n in shape:
            nbytes *= n
        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            buffer = free.pop() if free else None
            if buffer is not None:
                self._kept_bytes -= size
        if buffer is None:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self._pinned)
        return buffer[:nbytes].view(shape)

    def give_back(self, staged: torch.Tensor) -> None:
        buffer = staged._base if staged._base is not None else staged
        size = buffer.numel()
        with self._lock:
            if size != _size_class(size) or self._kept_bytes + size > self._max_kept:
                return  # not one of ours, or the pool is full: let it go
            self._free.setdefault(size, []).append(buffer)
            self._kept_bytes += size


    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return self._kept_bytes


def _size_class(nbytes: int) -> int:
    size = MIN_CLASS_BYTES
    while size < nbytes:
        size *= 2
    return size


class StagingExhausted(RuntimeError):
    """A registered staging arena has no room for another transfer now."""


class RegisteredStaging(_Staging):
    """HostStaging's interface over one arena allocated once, for a transport that registers
    memory with a NIC (Mooncake over RDMA): the arena is registered once (`regions()`), and a
    buffer carved from it is never freed, only handed out again, so no registered range ever
    outlives its memory (an RDMA registration pins the pages it was made on; memory freed and
    allocated again at the same address would not be those pages).

    Buffers are ranges of the arena, first fit, rounded to ARENA_ALIGN; a range given back is
    merged with free neighbours, so the arena never splits for good into sizes it once served.
    A transfer that finds no free range large enough gets StagingExhausted (the caller fails that
    transfer; the pull's failure policy then recomputes).
    """

    def __init__(self, arena_bytes: int, pinned: bool):
        self._arena = torch.empty(arena_bytes, dtype=torch.uint8, pin_memory=pinned)
        self._base = self._arena.data_ptr()
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, arena_bytes)] if arena_bytes else []  # (offset, size), sorted
        self._out: dict[int, int] = {}  # offset -> size of ranges handed out

    def regions(self) -> list[tuple[int, int]]:
        return [(self._base, self._arena.numel())]

    def take(self, shape: tuple[int, ...]) -> torch.Tensor:
        nbytes = 1
        for n in shape:
            nbytes *= n
        size = max(ARENA_ALIGN, -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN)
        with self._lock:
            for index, (offset, free) in enumerate(self._free):
                if free >= size:
                    self._free[index:index + 1] = [(offset + size, free - size)] if free > size else []
                    break
            else:
                raise StagingExhausted(
                    f"KV staging arena of {self._arena.numel() >> 20} MiB has no free {-(-size >> 20)} MiB range "
                    "for this transfer (transfers in flight hold the rest; raise kv_transfer.staging_mib)")
            self._out[offset] = size
        return self._arena[offset:offset + nbytes].view(shape)

    def give_back(self, staged: torch.Tensor) -> None:
        offset = staged.data_ptr() - self._base
        with self._lock:
            size = self._out.pop(offset, None)
            if size is None:
                return
            index = bisect.bisect(self._free, (offset, size))
            self._free.insert(index, (offset, size))
            # Merge with the free neighbours: the next one first, then the previous one.
            if index + 1 < len(self._free) and offset + size == self._free[index + 1][0]:
                self._free[index:index + 2] = [(offset, size + self._free[index + 1][1])]
            if index > 0 and self._free[index - 1][0] + self._free[index - 1][1] == offset:
                previous = self._free[index - 1]
                self._free[index - 1:index + 1] = [(previous[0], previous[1] + self._free[index][1])]


    @property
    def in_use_bytes(self) -> int:
        with self._lock:
            return sum(self._out.values())
