"""Transfer counters of one engine's connector (thread-safe; exported by the engine server)."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass
class _Counts:
    pulls_started_total: int = 0
    pulls_succeeded_total: int = 0
    pulls_failed_total: int = 0
    fallbacks_total: int = 0  # failed pulls that vLLM recomputes locally (policy "recompute")
    pulls_in_flight: int = 0
    blocks_requested_total: int = 0
    blocks_loaded_total: int = 0
    bytes_loaded_total: int = 0
    pull_seconds_total: float = 0.0
    leases_granted_total: int = 0
    blocks_leased_total: int = 0
    leases_released_total: int = 0
    leases_expired_total: int = 0
    releases_failed_total: int = 0
    # Pulls and releases failed at once, unattempted, because their peer was unreachable
    # moments ago (kv_transfer.peer_health); also counted in pulls_failed / releases_failed.
    peer_down_skips_total: int = 0


class TransferCounters:
    def __init__(self):
        self._lock = threading.Lock()
        self._c = _Counts()

    def pull_started(self, blocks: int) -> None:
        with self._lock:
            self._c.pulls_started_total += 1
            self._c.pulls_in_flight += 1
            self._c.blocks_requested_total += blocks

    def pull_succeeded(self, blocks: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._c.pulls_succeeded_total += 1
            self._c.pulls_in_flight -= 1
            self._c.blocks_loaded_total += blocks
            self._c.bytes_loaded_total += nbytes
            self._c.pull_seconds_total += seconds

    def pull_failed(self, fallback: bool, skipped: bool = False) -> None:
        with self._lock:
            self._c.pulls_failed_total += 1
            self._c.pulls_in_flight -= 1
            self._c.fallbacks_total += int(fallback)
            self._c.peer_down_skips_total += int(skipped)

    def lease_granted(self, blocks: int) -> None:
        with self._lock:
            self._c.leases_granted_total += 1
            self._c.blocks_leased_total += blocks

    def lease_released(self) -> None:
        with self._lock:
            self._c.leases_released_total += 1

    def lease_expired(self) -> None:
        with self._lock:
            self._c.leases_expired_total += 1

    def release_failed(self, skipped: bool = False) -> None:
        with self._lock:
            self._c.releases_failed_total += 1
            self._c.peer_down_skips_total += int(skipped)

    def snapshot(self) -> dict:
        with self._lock:
            return asdict(self._c)
