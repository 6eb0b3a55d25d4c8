"""Mooncake transfer engine plumbing shared by the "mooncake" server and client: creating an
engine, buffer addresses, and which memory an engine has registered.

Mooncake moves bytes only between registered ranges and refuses to register a range that
overlaps one it already has (rc -7), so `MemoryRegistry` keeps the registered ranges, merges
regions before registering them, and registers a page by itself only when no range covers it.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import threading

from kv_transfer.errors import TransferFailed

log = logging.getLogger(__name__)

PROTOCOLS = ("tcp", "rdma")  # Mooncake's transports we configure: tcp runs anywhere, rdma needs NICs
_RC_OVERLAP = -7  # register_memory: "does not support overlapped memory region"


def new_engine(hostname: str, protocol: str = "tcp", device_name: str = ""):
    """A TransferEngine in P2P-handshake mode (no metadata server); its rpc port is ephemeral.

    `hostname` is the address peers reach this engine at; `protocol` Mooncake's transport
    (tcp, or rdma over the NICs named in `device_name`, e.g. "mlx5_0,mlx5_1"; empty: Mooncake
    discovers them).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"Mooncake protocol {protocol!r}: choose one of {PROTOCOLS}")
    from mooncake.engine import TransferEngine  # optional dependency: only this backend needs it

    engine = TransferEngine()
    rc = engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name)
    if rc != 0:
        raise TransferFailed(f"Mooncake TransferEngine.initialize({hostname!r}, P2PHANDSHAKE, "
                             f"{protocol}, {device_name!r}) returned {rc}")
    return engine


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of a C-contiguous buffer (no copy)."""
    if view.nbytes == 0:
        return 0
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    import numpy as np  # read-only buffers: ctypes refuses them, numpy does not

    return int(np.frombuffer(view, np.uint8).ctypes.data)


def merge_ranges(regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, nbytes) ranges -> sorted [start, end) ranges with overlapping/touching merged."""
    merged: list[list[int]] = []
    for start, end in sorted((a, a + n) for a, n in regions if n > 0):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


class MemoryRegistry:
    """The ranges one engine has registered. Thread-safe.

    Ranges from `add_regions` stay until `clear`. Pages registered on their own (a source or
    sink without `regions()`) are cached by address; one that overlaps a new page can only be
    a freed buffer whose memory was reused, so it is unregistered to make room.
    """

    def __init__(self, engine):
        self._engine = engine
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted; parallel to _ranges
        self._ranges: list[tuple[int, int, bool]] = []  # (start, end, is_page)

    def add_regions(self, regions: list[tuple[int, int]]) -> None:
        with self._lock:
            for start, end in merge_ranges(regions):
                if self._covering(start, end) is None:
                    self._register(start, end, is_page=False)

    def ensure(self, view: memoryview) -> tuple[int, int | None]:
        """(address of `view`, start of the registered region it lies in or None), registering
        the view by itself first unless a registered range covers it."""
        address = buffer_address(view)
        if view.nbytes == 0:
            return address, None
        end = address + view.nbytes
        with self._lock:
            covering = self._covering(address, end)
            if covering is None:
                self._register(address, end, is_page=True)
                return address, None
        start, _, is_page = covering
        return address, None if is_page else start

    def clear(self) -> None:
        """Unregister everything (the engine is about to go away)."""
        with self._lock:
            for start, _, _ in self._ranges:
                self._engine.unregister_memory(start)
            self._starts, self._ranges = [], []

    def _covering(self, start: int, end: int) -> tuple[int, int, bool] | None:
        i = bisect.bisect_right(self._starts, start) - 1  # ranges never overlap: only i can
        return self._ranges[i] if i >= 0 and self._ranges[i][1] >= end else None

    def _register(self, start: int, end: int, *, is_page: bool) -> None:
        rc = self._engine.register_memory(start, end - start)
        if rc == _RC_OVERLAP and is_page and self._drop_stale_pages(start, end):
            rc = self._engine.register_memory(start, end - start)
        if rc != 0:
            raise TransferFailed(f"Mooncake register_memory({start:#x}, {end - start}) returned {rc}"
                                 + (" (overlaps a registered region)" if rc == _RC_OVERLAP else ""))
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._ranges.insert(i, (start, end, is_page))

    def _drop_stale_pages(self, start: int, end: int) -> bool:
        """Unregister page ranges overlapping [start, end); False if a region overlaps it."""
        overlapping = [r for r in self._ranges if r[0] < end and start < r[1]]
        if not overlapping or not all(is_page for _, _, is_page in overlapping):
            return False
        for r in overlapping:
            log.debug("unregistering stale Mooncake page range %#x+%d", r[0], r[1] - r[0])
            self._engine.unregister_memory(r[0])
            i = self._ranges.index(r)
            del self._starts[i], self._ranges[i]
        return True
