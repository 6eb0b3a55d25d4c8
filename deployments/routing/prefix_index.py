"""Which prompt blocks each replica's prefix cache holds, as far as the router can tell.

Approximate by default: a replica is assumed to hold the blocks of the prompts routed to it,
most recent first, up to its cache capacity (an LRU of chained block hashes, like the engine's
own eviction). Precise where the engine reports what it stored and evicted (`apply_events`).
A replica whose `epoch` changed (engine restarted) starts empty: routing to a cache it lost
would be the cache-blind-after-restart failure the issue warns about.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, capacity_blocks: int):
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._epochs: dict[str, str] = {}

    def sync(self, replica_ids: Iterable[str], epochs: dict[str, str] | None = None) -> None:
        """Drop replicas that are gone and empty those whose engine restarted."""
        live = set(replica_ids)
        for replica_id in list(self._blocks):
            if replica_id not in live:
                self._blocks.pop(replica_id)
                self._epochs.pop(replica_id, None)
        for replica_id, epoch in (epochs or {}).items():
            known = self._epochs.get(replica_id)
            self._epochs[replica_id] = epoch
            if known is not None and known != epoch:
                self._blocks.pop(replica_id, None)

    def replace(self, replica_id: str, block_hashes: Sequence[int]) -> None:
        """The engine's own report of what it holds (least recent first) replaces the estimate."""
        held: OrderedDict[int, None] = OrderedDict.fromkeys(block_hashes[-self.capacity_blocks:])
        self._blocks[replica_id] = held

    def hit_blocks(self, replica_id: str, block_hashes: Sequence[int]) -> int:
        """Length of the longest prefix of `block_hashes` the replica holds (chained hashes: the
        first miss ends the run, as in the engine's own prefix lookup)."""
        held = self._blocks.get(replica_id)
        if not held:
            return 0
        run = 0
        for block_hash in block_hashes:
            if block_hash not in held:
                break
            run += 1
        return run

    def record_routed(self, replica_id: str, block_hashes: Sequence[int]) -> None:
        """The replica will compute (or load) these blocks and keep them: most recent last."""
        held = self._blocks.setdefault(replica_id, OrderedDict())
        for block_hash in block_hashes:
            held[block_hash] = None
            held.move_to_end(block_hash)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def apply_events(self, replica_id: str, stored: Sequence[int] = (), removed: Sequence[int] = (),
                     cleared: bool = False) -> None:
        """The engine's own report (KV events): exact where the estimate guessed."""
        if cleared:
            self._blocks.pop(replica_id, None)
        held = self._blocks.setdefault(replica_id, OrderedDict())
        for block_hash in removed:
            held.pop(block_hash, None)
        self.record_routed(replica_id, stored)

    def held_blocks(self, replica_id: str) -> int:
        return len(self._blocks.get(replica_id, ()))
