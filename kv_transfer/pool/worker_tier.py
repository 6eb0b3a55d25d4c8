"""The pool, seen from vLLM's worker: move whole blocks between the KV cache and the pool.

A block travels as one object (`objects`): a 64-byte header, then the block's page of every
layer. A chunk of blocks is gathered from the KV cache into a registered staging buffer for a
put, and scattered from it after a get, with one batched copy per layer (kv_pages.KVPages, on
the cache's device; the staging is pinned when that is a GPU). The staging copy costs one copy
of the block on each side; what it buys is that nothing reaches the KV cache before its header
and checksum are verified, and that the pool never sees memory vLLM may reuse. Loads and
stores have a staging buffer each, so a long store never delays a load.

Failures: `PoolUnavailable` from the store, `CorruptObject` from verification, a missing
object: a load raises (the connector reports the request's load failed and vLLM recomputes
under the manifest's failure policy); a store gives up quietly (counted): the pool is a cache.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch

from kv_transfer.errors import KVTransferError
from kv_transfer.pool.health import PoolHealth
from kv_transfer.pool.keys import KeySpace
from kv_transfer.pool.objects import HEADER_BYTES, BlockLayout, encode_header, payload_checksum, verify
from kv_transfer.pool.records import LookupTally, PoolBlock
from kv_transfer.pool.session_pins import SessionPins
from kv_transfer.pool.store import PoolStore, PoolUnavailable

logger = logging.getLogger(__name__)

WARM_UP_S = 10.0  # how long an engine's start waits to join the pool (a down pool costs this once)


@dataclass(frozen=True)
class PoolLoaded:
    """What one load read: its bytes, and the blocks and seconds of the chunks that the disk tier
    served (a request's `pool_disk_load` phase)."""

    nbytes: int
    disk_blocks: int = 0
    disk_s: float = 0.0


class PoolLoadFailed(KVTransferError):
    """A block the lookup found could not be read from the pool (evicted, failed, corrupt)."""


@dataclass
class PoolCounts:
    lookups_total: int = 0
    lookup_blocks_total: int = 0
    lookup_hit_blocks_total: int = 0
    lookup_failures_total: int = 0
    loads_total: int = 0
    load_failures_total: int = 0
    corrupt_objects_total: int = 0
    blocks_loaded_total: int = 0
    bytes_loaded_total: int = 0
    load_seconds_total: float = 0.0
    # Of those, what was read from the disk tier (a store with one): blocks, bytes and the time
    # of the reads of chunks that had any object on disk.
    disk_blocks_loaded_total: int = 0
    disk_bytes_loaded_total: int = 0
    disk_load_seconds_total: float = 0.0
    stores_total: int = 0
    store_failures_total: int = 0
    blocks_stored_total: int = 0
    blocks_already_pooled_total: int = 0
    blocks_refused_total: int = 0  # the pool was full (or refused the put)
    bytes_stored_total: int = 0
    store_seconds_total: float = 0.0
    stores_shed_total: int = 0  # dropped unrun: too many pending, or waited too long (StoreQueue)
    blocks_shed_total: int = 0
    # Sessions (kv_pool.sessions): objects put or upserted with a soft pin, and of those the held
    # objects whose pin was renewed.
    blocks_pinned_total: int = 0
    blocks_renewed_total: int = 0
    up: int = 1


class PoolWorker:
    def __init__(self, store: Callable[[], PoolStore], keys: KeySpace, tp_rank: int, health: PoolHealth,
                 staging_bytes: int, clock: Callable[[], float] = time.monotonic,
                 pins: SessionPins | None = None):
        self._store_factory = store
        self._pins = pins  # None: requests of sessions are stored like any other
        self._keys = keys
        self._rank = tp_rank
        self._health = health
        self._clock = clock
        self._staging_bytes = staging_bytes
        self._lock = threading.Lock()  # counters
        self._counts = PoolCounts()
        self._pages = None
        self._layout: BlockLayout | None = None
        self._staging: dict[str, tuple[torch.Tensor, threading.Lock]] = {}
        self._registered_with: PoolStore | None = None

    def attach(self, pages) -> None:
        """Called once the KV cache exists (register_kv_caches); `pages`: kv_pages.KVPages."""
        self._pages = pages
        self._layout = BlockLayout(pages.num_layers, pages.page_bytes)
        blocks = max(1, self._staging_bytes // self._layout.object_bytes)
        pinned = pages.device.type == "cuda"  # device copies to and from it run asynchronously
        for purpose in ("load", "store"):
            buffer = torch.zeros(blocks * self._layout.object_bytes, dtype=torch.uint8, pin_memory=pinned)
            self._staging[purpose] = (buffer, threading.Lock())
        # Join the pool (and mount this engine's segment) while the engine starts, not on the
        # first request, whose lookup would find the client still connecting.
        store = self._store_factory()
        if store.connect(WARM_UP_S):
            try:
                self._usable_store()
            except PoolUnavailable as exc:
                logger.warning("kv pool: registering staging buffers failed at start (%s); retried on use", exc)
        else:
            logger.warning("kv pool: not joined after %.0f s at engine start; serving without it until it is", WARM_UP_S)

    @property
    def _pin_s(self) -> float:
        return self._pins.pin_s if self._pins is not None else 0.0

    @property
    def layout(self) -> BlockLayout | None:
        return self._layout

    # -- loads ----------------------------------------------------------------------------------

    def load(self, blocks: Sequence[PoolBlock]) -> PoolLoaded:
        """Read every block into the KV cache, verified. Raises on any failure."""
        started = time.perf_counter()
        nbytes, disk_blocks, disk_s = 0, 0, 0.0
        try:
            store = self._usable_store()
            with self._staging_for("load") as (buffer, per_chunk):
                for start in range(0, len(blocks), per_chunk):
                    chunk = self._load_chunk(store, blocks[start:start + per_chunk], buffer,
                                             later=blocks[start + per_chunk:])
                    nbytes, disk_blocks, disk_s = (nbytes + chunk.nbytes, disk_blocks + chunk.disk_blocks,
                                                   disk_s + chunk.disk_s)
        except PoolUnavailable as exc:
            self._down(exc)
            self._count(load_failures_total=1)
            raise
        except KVTransferError:
            self._count(load_failures_total=1)
            raise
        self._health.succeeded()
        self._count(loads_total=1, blocks_loaded_total=len(blocks), bytes_loaded_total=nbytes,
                    load_seconds_total=time.perf_counter() - started)
        return PoolLoaded(nbytes, disk_blocks, disk_s)

    def _load_chunk(self, store: PoolStore, chunk: Sequence[PoolBlock], buffer: torch.Tensor,
                    later: Sequence[PoolBlock] = ()) -> PoolLoaded:
        size = self._layout.object_bytes
        keys = [self._keys.key(b.block_hash, self._rank) for b in chunk]
        base = buffer.data_ptr()
        on_disk = 0
        if getattr(store, "has_disk_tier", False):
            on_disk = store.tiers_of(keys).count("disk")
        started = time.perf_counter()
        got = store.get_into(keys, [base + i * size for i in range(len(chunk))], [size] * len(chunk))
        disk_s = time.perf_counter() - started if on_disk else 0.0
        if on_disk:
            self._count(disk_blocks_loaded_total=on_disk, disk_bytes_loaded_total=on_disk * self._layout.payload_bytes,
                        disk_load_seconds_total=disk_s)
        view = memoryview(buffer.numpy())  # our staging buffer (host), never engine memory
        for i, (block, key, read) in enumerate(zip(chunk, keys, got)):
            if read != size:
                raise PoolLoadFailed(f"pool object {key} missing or unreadable (read {read} of {size} B)")
            try:
                verify(view[i * size:(i + 1) * size], key, block.token_digest, self._layout)
            except KVTransferError:
                self._count(corrupt_objects_total=1)
                # This block and the ones after it are recomputed and stored again; a store
                # skips keys the pool holds, so they must go (the rest may be corrupt too).
                self._drop_corrupt(store, keys[i:] + [self._keys.key(b.block_hash, self._rank) for b in later])
                raise
        # Every object of the chunk verified: into the cache in one batched copy per layer.
        self._pages.scatter([b.block_id for b in chunk], self._payloads(buffer, len(chunk)))
        return PoolLoaded(len(chunk) * self._layout.payload_bytes, on_disk, disk_s)

    def _drop_corrupt(self, store: PoolStore, keys: list[str]) -> None:
        """Objects are immutable and a store skips keys the pool holds: a corrupt object left
        in place would fail every later load of its block. Best effort: the load fails anyway."""
        try:
            store.remove(keys)
        except Exception as exc:  # noqa: BLE001 - the pool may be going down as well
            logger.warning("kv pool: could not remove corrupt object %s and %d after it: %s", keys[0],
                           len(keys) - 1, exc)

    # -- stores ---------------------------------------------------------------------------------

    def store(self, blocks: Sequence[PoolBlock], session: bool = False, history_blocks: int = 0) -> int:
        """Write the blocks the pool does not hold yet; blocks stored. Never raises. `session`:
        the request belongs to a session (pins: `session_pins`), so its new objects are pinned
        and the held ones among its first `history_blocks` (the history it reused) have their
        pins renewed when due, within the engine's pin budget."""
        if not blocks or not self._health.usable(self._clock()):
            return 0
        started = time.perf_counter()
        stored = 0
        try:
            store = self._usable_store()
            with self._staging_for("store") as (buffer, per_chunk):
                for start in range(0, len(blocks), per_chunk):
                    stored += self._store_chunk(store, blocks[start:start + per_chunk], buffer, session,
                                                history=max(0, history_blocks - start))
        except PoolUnavailable as exc:
            self._down(exc)
            self._count(store_failures_total=1)
            return stored
        self._health.succeeded()
        self._count(stores_total=1, store_seconds_total=time.perf_counter() - started)
        return stored

    def shed(self, blocks: Sequence[PoolBlock]) -> None:
        """Count a store that was dropped without running (the pool is a cache; the engine's
        KV is not: see kv_transfer.pool.store_queue)."""
        self._count(stores_shed_total=1, blocks_shed_total=len(blocks))

    def _store_chunk(self, store: PoolStore, chunk: Sequence[PoolBlock], buffer: torch.Tensor,
                     session: bool = False, history: int = 0) -> int:
        """`history`: how many of the chunk's first blocks are the session's reused history."""
        keys = [self._keys.key(b.block_hash, self._rank) for b in chunk]
        present = store.exists(keys)
        new = [(b, k) for b, k, p in zip(chunk, keys, present) if not p]
        held = [(b, k) for i, (b, k, p) in enumerate(zip(chunk, keys, present)) if p and i < history]
        self._count(blocks_already_pooled_total=sum(present))
        size = self._layout.object_bytes
        pin_new, renew = (False,) * len(new), []
        if session and self._pins is not None:
            plan = self._pins.plan([k for _, k in new], [k for _, k in held], size, self._clock())
            pin_new = plan.pin_new
            renew = self._in_memory(store, [row for row, due in zip(held, plan.renew) if due])
        todo = new + renew
        if not todo:
            return 0
        with self._pages.gathered([block.block_id for block, _ in todo]) as gathered:
            self._payloads(buffer, len(todo)).copy_(gathered)  # each object: its header, then this
        view = memoryview(buffer.numpy())
        for slot, (block, key) in enumerate(todo):
            obj = view[slot * size:(slot + 1) * size]
            payload = obj[HEADER_BYTES:]
            obj[:HEADER_BYTES] = encode_header(key, block.token_digest, self._layout, payload_checksum(payload))
        slots = list(range(len(todo)))
        pinned = [slot for slot in slots[:len(new)] if pin_new[slot]]
        unpinned = [slot for slot in slots[:len(new)] if not pin_new[slot]]
        ok = dict(zip(unpinned, self._put(store, buffer, todo, unpinned)))
        ok.update(zip(pinned, self._put(store, buffer, todo, pinned, pin_s=self._pin_s)))
        renewed = slots[len(new):]
        ok.update(zip(renewed, self._put(store, buffer, todo, renewed, pin_s=self._pin_s, replace=True)))
        stored = sum(1 for slot in slots[:len(new)] if ok[slot])
        now_pinned = [todo[slot][1] for slot in pinned + renewed if ok[slot]]
        if now_pinned:
            self._pins.pinned(now_pinned, size, self._clock())
        self._count(blocks_stored_total=stored, blocks_refused_total=len(new) - stored,
                    bytes_stored_total=stored * self._layout.payload_bytes,
                    blocks_pinned_total=len(now_pinned),
                    blocks_renewed_total=sum(1 for slot in renewed if ok[slot]))
        return stored

    def _put(self, store: PoolStore, buffer: torch.Tensor, todo: list, slots: list[int], pin_s: float = 0.0,
             replace: bool = False) -> list[bool]:
        """Put (or upsert) the staged objects in these slots of the buffer."""
        if not slots:
            return []
        size, base = self._layout.object_bytes, buffer.data_ptr()
        keys = [todo[slot][1] for slot in slots]
        addresses = [base + slot * size for slot in slots]
        return store.put_from(keys, addresses, [size] * len(slots), pin_s=pin_s, replace=replace)

    @staticmethod
    def _in_memory(store: PoolStore, rows: list) -> list:
        """The rows whose object is in DRAM now. An upsert of an object held only on disk needs
        new room, and one refused (-200) left its key unreadable for ~30 s (Mooncake 0.3.13,
        measured; docs/long-context.md): such objects keep their disk copy, and Mooncake
        promotes them on their next reads. Without a disk tier a held object is in DRAM."""
        if not rows or not getattr(store, "has_disk_tier", False):
            return rows
        tiers = store.tiers_of([key for _, key in rows])
        return [row for row, tier in zip(rows, tiers) if tier == "memory"]

    # -- counters -------------------------------------------------------------------------------

    def add_lookups(self, tally: LookupTally) -> None:
        if tally.lookups or tally.failures:
            self._count(lookups_total=tally.lookups, lookup_blocks_total=tally.blocks_queried,
                        lookup_hit_blocks_total=tally.blocks_hit, lookup_failures_total=tally.failures)

    def snapshot(self) -> dict:
        with self._lock:
            counts = asdict(self._counts)
        counts["up"] = int(self._health.up)
        return {f"pool_{name}": value for name, value in counts.items()}

    # -- internals ------------------------------------------------------------------------------

    def _usable_store(self) -> PoolStore:
        if self._layout is None:
            raise PoolUnavailable("the KV cache is not registered yet")
        store = self._store_factory()
        if store is not self._registered_with:  # a new client (first use, or after a reconnect)
            for buffer, _ in self._staging.values():
                store.register_buffer(buffer.data_ptr(), buffer.nbytes)
            self._registered_with = store
        return store

    @contextlib.contextmanager
    def _staging_for(self, purpose: str):
        """This purpose's staging buffer (held exclusively) and how many objects fit in it."""
        buffer, lock = self._staging[purpose]
        with lock:
            yield buffer, buffer.nbytes // self._layout.object_bytes

    def _payloads(self, buffer: torch.Tensor, count: int) -> torch.Tensor:
        """The payloads of the first `count` objects in `buffer` as [layers, count, page_bytes]
        (KVPages' gather/scatter shape): a strided view, each object's header left out."""
        layout = self._layout
        objects = buffer[:count * layout.object_bytes].view(count, layout.object_bytes)
        return objects[:, HEADER_BYTES:].view(count, layout.num_layers, layout.page_bytes).transpose(0, 1)

    def _down(self, exc: Exception) -> None:
        first = self._health.up
        self._health.failed(self._clock(), str(exc))
        if first:
            logger.warning("kv pool: %s; serving without the pool for %.0f s", exc, self._health.retry_after_s)

    def _count(self, **deltas) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self._counts, name, getattr(self._counts, name) + value)
