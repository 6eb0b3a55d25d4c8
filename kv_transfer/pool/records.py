"""What the scheduler side asks the worker side to do with the pool (inside the StepPlan)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolBlock:
    """One block to load or store: vLLM's chained hash (the key), the digest of its token ids
    (checked against the object's header), and the engine's local block id."""

    block_hash: bytes
    token_digest: bytes
    block_id: int


@dataclass(frozen=True)
class PoolStoreJob:
    """Write these blocks to the pool. `holds_blocks`: the scheduler delayed freeing them for
    this store alone (no lease), so the worker reports the request finished_sending after it."""

    request_id: str
    blocks: tuple[PoolBlock, ...]
    holds_blocks: bool
    session: bool = False  # part of a session: pin its new objects (session_pins)
    history_blocks: int = 0
    """Of a session's blocks, how many lead the list as history it reused (found in the engine's
    prefix cache or loaded from the pool): held objects among them get their pins renewed.
    Blocks this request computed, or pulled from a prefill that stored them, are not renewed."""


@dataclass
class LookupTally:
    """Scheduler-side pool lookups since the last step (the worker keeps the counters)."""

    lookups: int = 0
    blocks_queried: int = 0
    blocks_hit: int = 0
    failures: int = 0

    def add(self, queried: int, hit: int) -> None:
        self.lookups += 1
        self.blocks_queried += queried
        self.blocks_hit += hit
