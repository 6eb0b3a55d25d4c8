"""What one engine's prefix cache holds, rebuilt from its KV cache events, in the router's hashes.

vLLM publishes `BlockStored` (the engine's block hashes, their parent's hash and the blocks'
token ids), `BlockRemoved` and `AllBlocksCleared`. The router names a prompt block by its own
chained hash (`block_hashes.chain_hash`), so each stored block's router hash is computed from
its parent's router hash and its tokens: a mirror must see a block's parent before the block.
One that joined late (the engine ran before the subscriber) does not know the parents of
blocks stored before it joined: those later blocks are dropped (`orphans`) rather than guessed,
and a replay of the engine's buffered events, asked for at subscription, fills the gap.

Plain data in, plain data out: the subscriber (kv_event_subscriber.py) does the I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from deployments.routing.block_hashes import chain_hash


class EngineCacheMirror:
    def __init__(self, max_blocks: int = 1 << 20):
        self.block_size: int | None = None
        self._router_hash: dict[Hashable, int] = {}  # engine block hash -> router hash
        self._resident: OrderedDict[int, None] = OrderedDict()  # router hashes, least recent first
        self._max_blocks = max_blocks
        self.orphans = 0  # stored blocks whose parent was never seen

    def stored(self, engine_hashes: Sequence[Hashable], parent: Hashable | None, token_ids: Sequence[int],
               block_size: int) -> None:
        self.block_size = block_size
        if parent is not None and parent not in self._router_hash:
            self.orphans += len(engine_hashes)
            return
        router_parent = None if parent is None else self._router_hash[parent]
        for index, engine_hash in enumerate(engine_hashes):
            tokens = token_ids[index * block_size:(index + 1) * block_size]
            if len(tokens) < block_size:
                break
            router_parent = chain_hash(router_parent, tokens)
            self._router_hash[engine_hash] = router_parent
            self._resident[router_parent] = None
            self._resident.move_to_end(router_parent)
        while len(self._resident) > self._max_blocks:
            self._resident.popitem(last=False)

    def removed(self, engine_hashes: Sequence[Hashable]) -> None:
        for engine_hash in engine_hashes:
            router_hash = self._router_hash.pop(engine_hash, None)
            if router_hash is not None:
                self._resident.pop(router_hash, None)

    def cleared(self) -> None:
        self._router_hash.clear()
        self._resident.clear()

    def snapshot(self, limit: int) -> list[int]:
        """Up to `limit` resident blocks, the most recently stored last."""
        resident = list(self._resident)
        return resident[-limit:] if limit else []

    def __len__(self) -> int:
        return len(self._resident)
