"""The pool, seen from vLLM's scheduler: how many further blocks to load, and what to store.

Lookup rule: after vLLM's own prefix cache matched the first `local` tokens (block aligned),
the pool may supply the longest run of the *following* full prompt blocks that it holds for
every tensor-parallel rank; the first missing block ends the run (each block's KV depends on
all blocks before it, so a later hit is useless without the earlier ones). One batched
`exists` call per fresh request; none while the pool's breaker is open (`PoolHealth`).
vLLM asks again at every step while a request waits for KV blocks (15 times per request on
the MLA benchmark, BENCHMARKS 8d), and each call blocks the scheduler's loop on a round trip
to the master: an answer younger than `reuse_s` for the same blocks is reused. A block evicted
in that second fails its load, which recomputes like any failed load.

Store rule: when a request finishes normally, every full block whose KV the engine computed
(prompt and generated tokens alike, `num_computed_tokens // block_size`) and that did not come
from the pool is offered to the worker; the worker skips what the pool already holds. So
prefill contributes prompts, decode contributes whole conversations, and the next turn's
lookup finds its history. A request of a session (`kv_pool.sessions`) also offers the blocks it
loaded, so that the worker renews their pins (`session_pins`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from kv_transfer.params import in_session
from kv_transfer.pool.health import PoolHealth
from kv_transfer.pool.keys import KeySpace
from kv_transfer.pool.objects import token_digest
from kv_transfer.pool.records import LookupTally, PoolBlock, PoolStoreJob
from kv_transfer.pool.store import PoolStore, PoolUnavailable

logger = logging.getLogger(__name__)

LOOKUP_REUSE_S = 1.0


class PoolScheduler:
    def __init__(self, store: Callable[[], PoolStore], keys: KeySpace, block_size_tokens: int,
                 health: PoolHealth, clock: Callable[[], float] = time.monotonic, reuse_s: float = LOOKUP_REUSE_S,
                 sessions: bool = False):
        self._store = store  # created on first use: the engine must start even if the pool is down
        self._keys = keys
        self._block_size = block_size_tokens
        self._health = health
        self._clock = clock
        self._hits: dict[str, tuple[int, int]] = {}  # request id -> (first block, blocks) of its latest lookup
        self._loaded: dict[str, tuple[int, int]] = {}  # request id -> (first block, blocks) read from the pool
        self._recent: dict[str, tuple[int, int, int, float]] = {}  # request id -> (first, last, hit, at_s)
        self._local: dict[str, int] = {}  # request id -> blocks its engine's prefix cache held at lookup
        self._reuse_s = reuse_s
        self._sessions = sessions  # kv_pool.sessions: a session's stores pin, and renew what it reused
        self.tally = LookupTally()

    def warm_up(self, wait_s: float) -> None:
        """Join the pool while the engine starts: a first lookup that found the client still
        connecting would count as a failure and close the pool for retry_after_s."""
        if not self._store().connect(wait_s):
            logger.warning("kv pool: not joined after %.0f s at engine start; lookups will retry", wait_s)

    # -- lookup (at admission) -----------------------------------------------------------------

    def lookup(self, request: Any, local_tokens: int) -> int:
        """Full blocks after `local_tokens` that the pool holds (0 when it is unusable)."""
        first = local_tokens // self._block_size
        if self._sessions:
            self._local[request.request_id] = first
        hashes = list(getattr(request, "block_hashes", None) or ())
        last = min(len(hashes), len(request.prompt_token_ids or ()) // self._block_size)
        now_s = self._clock()
        if first >= last or not self._health.usable(now_s):
            self._hits.pop(request.request_id, None)
            return 0
        recent = self._recent.get(request.request_id)
        if recent is not None and recent[:2] == (first, last) and now_s - recent[3] < self._reuse_s:
            hit = recent[2]  # asked again while waiting for blocks: the answer is fresh
        else:
            hit = self._ask_pool(hashes[first:last])
            if hit is None:
                return 0
            self._recent[request.request_id] = (first, last, hit, now_s)
        if hit:
            self._hits[request.request_id] = (first, hit)
        else:
            self._hits.pop(request.request_id, None)
        return hit

    def _ask_pool(self, wanted: list) -> int | None:
        """The run of `wanted` blocks the pool holds for every rank; None when the pool failed."""
        keys = [key for block_hash in wanted for key in self._keys.keys_all_ranks(block_hash)]
        try:
            present = self._store().exists(keys)
        except PoolUnavailable as exc:
            self._failed(exc)
            return None
        self._health.succeeded()
        ranks = self._keys.tp_size
        hit = 0
        for index in range(len(wanted)):
            if not all(present[index * ranks:(index + 1) * ranks]):
                break
            hit += 1
        self.tally.add(len(wanted), hit)
        return hit

    def take_hit(self, request_id: str) -> tuple[int, int]:
        """(first block, blocks) the latest lookup of this request found; forgets it."""
        return self._hits.pop(request_id, (0, 0))

    def load_blocks(self, request: Any, first_block: int, local_block_ids: list[int]) -> tuple[PoolBlock, ...]:
        """The blocks to read from the pool into these freshly allocated local blocks."""
        return tuple(self._block(request, first_block + i, block_id) for i, block_id in enumerate(local_block_ids))

    # -- store (at the end of a request) -------------------------------------------------------

    def store_job(self, request: Any, block_ids: list[int], holds_blocks: bool) -> PoolStoreJob | None:
        """Blocks of a normally finished request worth storing, or None."""
        hashes = list(getattr(request, "block_hashes", None) or ())
        computed = int(request.num_computed_tokens) // self._block_size
        count = min(len(hashes), computed, len(block_ids))
        first, loaded = self._loaded.pop(request.request_id, (0, 0))
        local = self._local.pop(request.request_id, 0)
        session = self._sessions and in_session(request.kv_transfer_params)
        # A session's job names its loaded blocks too: the worker renews the pins of its history
        # (what it found cached or loaded); any other request's loaded blocks are pooled already.
        skip = set() if session else set(range(first, first + loaded))
        blocks = tuple(self._block(request, i, block_ids[i]) for i in range(count) if i not in skip)
        if not blocks or not self._health.usable(self._clock()):
            return None
        history = min(count, first + loaded if loaded else local) if session else 0
        return PoolStoreJob(request.request_id, blocks, holds_blocks, session=session, history_blocks=history)

    def loaded(self, request_id: str, first_block: int, blocks: int) -> None:
        """Remember which blocks came from the pool (not stored again at the end)."""
        self._loaded[request_id] = (first_block, blocks)

    def load_failed(self, request_id: str) -> None:
        """The worker could not read the blocks `loaded` named (the bad objects are gone from the
        pool) and the engine recomputed them: store them at the end like any computed block."""
        self._loaded.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self._hits.pop(request_id, None)
        self._loaded.pop(request_id, None)
        self._recent.pop(request_id, None)
        self._local.pop(request_id, None)

    def take_tally(self) -> LookupTally:
        tally, self.tally = self.tally, LookupTally()
        return tally

    # -- internals ------------------------------------------------------------------------------

    def _block(self, request: Any, index: int, block_id: int) -> PoolBlock:
        start = index * self._block_size
        tokens = request.all_token_ids[start:start + self._block_size]
        return PoolBlock(bytes(request.block_hashes[index]), token_digest(tokens), int(block_id))

    def _failed(self, exc: Exception) -> None:
        first = self._health.up
        self._health.failed(self._clock(), str(exc))
        self.tally.failures += 1
        if first:
            logger.warning("kv pool: lookup failed (%s); serving without the pool for %.0f s",
                           exc, self._health.retry_after_s)
