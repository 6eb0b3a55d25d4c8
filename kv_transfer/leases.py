"""Prefill-side leases on KV blocks (pure: no I/O, time comes in as `now_s`).

After a prefill finishes, its KV blocks stay allocated so a decode worker can pull them. A
lease records which blocks a request holds and until when. Rule: a lease ends when the decode
side releases it, or when `now_s >= deadline_s` and the owner calls `expire` (the decode side
died or gave up); either way the caller frees the returned lease's blocks in the engine.
`extend` pushes the deadline to `now_s + lease_s` for slow decode admissions.

The table is called from the transfer server thread and the engine thread, so every method
takes one internal lock; none of them block on anything else.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable

from kv_transfer.errors import LeaseExistsError


@dataclass(frozen=True)
class Lease:
    """Blocks one request holds on the prefill engine, and until when."""

    request_id: str
    block_ids: tuple[int, ...]
    granted_at_s: float
    deadline_s: float

    def covers(self, block_ids: Iterable[int]) -> bool:
        """Whether every block in `block_ids` belongs to this lease."""
        held = set(self.block_ids)
        return all(b in held for b in block_ids)


class LeaseTable:
    """Outstanding leases by request id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._blocks = 0

    def grant(self, request_id: str, block_ids: Iterable[int], now_s: float, lease_s: float) -> Lease:
        """Record that `request_id` holds `block_ids` until `now_s + lease_s`.

        A second grant for a held request raises LeaseExistsError: silently replacing it
        would leak the first grant's blocks.
        """
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        lease = Lease(request_id, tuple(block_ids), now_s, now_s + lease_s)
        with self._lock:
            if request_id in self._leases:
                raise LeaseExistsError(request_id)
            self._leases[request_id] = lease
            self._blocks += len(lease.block_ids)
        return lease

    def release(self, request_id: str) -> Lease | None:
        """Remove and return the lease; None when already released or expired (idempotent)."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is not None:
                self._blocks -= len(lease.block_ids)
        return lease

    def expire(self, now_s: float) -> list[Lease]:
        """Remove and return the leases whose deadline has passed, earliest deadline first."""
        # A linear scan: outstanding leases number in the hundreds (one per request between
        # prefill and decode admission), and the caller runs this once per engine step at most.
        with self._lock:
            expired = [lease for lease in self._leases.values() if lease.deadline_s <= now_s]
            for lease in expired:
                del self._leases[lease.request_id]
                self._blocks -= len(lease.block_ids)
        return sorted(expired, key=lambda lease: lease.deadline_s)

    def extend(self, request_id: str, now_s: float, lease_s: float) -> Lease | None:
        """Move the deadline to `now_s + lease_s` (never earlier); None when not held."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return None
            deadline_s = max(lease.deadline_s, now_s + lease_s)
            lease = Lease(lease.request_id, lease.block_ids, lease.granted_at_s, deadline_s)
            self._leases[request_id] = lease
        return lease

    def get(self, request_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(request_id)

    def outstanding(self) -> int:
        """Number of leases held."""
        with self._lock:
            return len(self._leases)

    def outstanding_blocks(self) -> int:
        """Blocks held across all leases (the prefill engine's KV memory pinned for decode)."""
        with self._lock:
            return self._blocks
