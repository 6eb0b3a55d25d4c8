"""The KV pool's store interface: what the connector needs from a cluster-wide object store.

One adapter implements it per store (Mooncake Store: `kv_transfer.pool.mooncake_store`); unit
tests use an in-memory fake with the same interface. The connector only ever moves whole,
immutable objects (one KV block of every layer, with a verified header: `pool.objects`), so
the interface is batch exists / put / get on registered memory and nothing else.

Every method may raise `PoolUnavailable` (master unreachable, client not set up, a timeout):
callers then serve without the pool (recompute) and count it. A missing key is not an error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol, Sequence

from kv_transfer.errors import KVTransferError


class PoolUnavailable(KVTransferError):
    """The pool could not answer (down, unreachable, slow); serve without it."""


@dataclass(frozen=True)
class PoolSettings:
    """Where the pool is and what this engine contributes (kv_connector_extra_config["pool"])."""

    backend: str = "mooncake"
    master_address: str = ""  # "host:port" of the store's master (its RPC port)
    metadata_url: str = ""  # Mooncake's HTTP metadata server, e.g. http://host:port/metadata
    local_hostname: str = "127.0.0.1"  # the address peers reach this client's segment at
    protocol: str = "tcp"  # tcp on CPU; rdma on GPU clusters
    device_name: str = ""  # RDMA device(s), "" for tcp
    segment_bytes: int = 256 << 20  # memory this engine contributes to the pool
    local_buffer_bytes: int = 64 << 20  # the client's transfer buffer
    key_prefix: str = "moe"  # namespace: application name, so two apps never share objects
    failure_policy: str = "recompute"  # on a failed pool load: recompute | fail
    retry_after_s: float = 10.0  # after the pool failed, skip it this long before trying again
    max_pending_stores: int = 64
    """Stores queued or running in one worker at most. A stored request's blocks stay held until
    its store is done, so a slow pool would otherwise hold ever more of the engine's KV; a store
    offered beyond this is dropped at once (its blocks freed, counted in pool_stores_shed_total)."""
    max_store_wait_s: float = 5.0
    """A store that waited longer than this for its turn is dropped instead of run: its blocks
    have been held that long already, and the queue ahead of it says the pool is not keeping up."""
    disk_dir: str = ""
    """A disk tier under this engine's segment (Mooncake's offload): its folder, which only this
    engine writes to (kv_pool.disk.path/<application>/<engine>); "": DRAM only."""
    disk_bytes: int = 0
    """Disk this engine's tier may fill (least recently used objects dropped past it)."""
    session_pin_s: float = 0.0
    """kv_pool.sessions.idle_s: a session's objects are pinned in DRAM this long after its last
    turn stored or renewed them (0: no session retention; session_pins)."""
    session_pin_share: float = 0.5
    """The share of this engine's segment its live pins may take (the rest stays evictable)."""
    weights_id: str = ""
    """Names the checkpoint's weights in the pool's key space instead of their files' sizes and
    mtimes (see kv_transfer.pool.keys.Checkpoint): set it (a release tag, a content hash) when
    each node holds its own copy with other mtimes, so that engines on all nodes share blocks.
    Change it whenever the weights change, or engines load KV of the old weights."""

    def __post_init__(self) -> None:
        if self.max_pending_stores < 1:
            raise ValueError(f"kv pool max_pending_stores must be at least 1, got {self.max_pending_stores}")
        if not self.max_store_wait_s > 0:
            raise ValueError(f"kv pool max_store_wait_s must be above 0 s, got {self.max_store_wait_s}")
        if self.session_pin_s < 0 or not 0 <= self.session_pin_share < 1:
            raise ValueError(f"kv pool session pins: {self.session_pin_s} s and a {self.session_pin_share} share of the "
                             "segment; need at least 0 s and a share in [0, 1)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "PoolSettings | None":
        if not data:
            return None
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown kv pool settings {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        return cls(**data)


class PoolStore(Protocol):
    """A cluster-wide object store. Thread-safe. Addresses are in registered memory."""

    def connect(self, wait_s: float) -> bool:
        """Start joining the pool now (engine start-up), waiting up to `wait_s`; True if joined.
        Calls join by themselves too, but only within their own deadline."""

    def register_buffer(self, address: int, nbytes: int) -> None:
        """Make [address, address+nbytes) usable by put_from/get_into (once, at start)."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which keys hold a complete object now."""

    def put_from(self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int],
                 pin_s: float = 0.0, replace: bool = False) -> list[bool]:
        """Store each object (immutable: a key that already exists counts as stored, unchanged).
        Returns per key whether the pool now holds it (False: full, refused). `pin_s` > 0: keep
        it in DRAM for that long while unpinned objects are evicted first (a soft pin; stores
        without pins ignore it). `replace`: write it even if the key exists (same bytes: that
        renews the pin; only for objects in DRAM, see worker_tier._in_memory)."""

    def get_into(self, keys: Sequence[str], addresses: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Read each object into its buffer: bytes read per key, or a negative number when the
        key is missing or the read failed (the caller recomputes that block and the rest)."""

    def remove(self, keys: Sequence[str]) -> None:
        """Drop the objects (a corrupt one, so that the next store writes it afresh); missing
        keys are fine. Raises PoolUnavailable when the pool cannot be reached."""

    def tiers_of(self, keys: Sequence[str]) -> list[str]:
        """Where each object is: "memory", "disk" or "missing" (stores with a disk tier only;
        callers check `has_disk_tier` first)."""

    def stats(self) -> dict[str, float]:
        """Capacity figures when the store knows them (e.g. segment_bytes); may be empty."""

    def close(self) -> None:
        """Leave the pool (this client's segment goes away with it)."""
