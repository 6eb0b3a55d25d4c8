"""The plain records routing policies read and return. No Ray, no vLLM: tests build them by hand."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicaState:
    """What the router knows of one engine replica at a moment.

    `ongoing` counts requests this router has sent and not seen finish (always fresh);
    `queued`/`kv_usage`/`prompt_tokens_pending` come from the replica's own report at
    `reported_at_s` and go stale.
    `epoch` changes when the engine restarts: its cache is then empty whatever was sent before.
    """

    replica_id: str
    ongoing: int = 0
    queued: int = 0
    kv_usage: float = 0.0  # 0..1 of the engine's KV blocks in use
    # Prompt tokens of the requests in the engine that have no first token yet (and no KV pulled
    # for them): the prefill work still ahead of a new request there.
    prompt_tokens_pending: int = 0
    reported_at_s: float | None = None
    epoch: str = ""
    # The engine's own account of its prefix cache (router block hashes, from its KV events);
    # None: not reported, the router estimates from what it routed there.
    resident: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RoutingRequest:
    """A request as routing sees it: the chained hashes of its full prompt blocks, in order."""

    block_hashes: tuple[int, ...] = ()
    session_id: str | None = None

    @property
    def blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(frozen=True)
class RouteDecision:
    replica_id: str
    reason: str  # round_robin | least_loaded | prefix | pool_prefix | session | load_gate | only_replica
    expected_hit_blocks: int = 0
    scores: dict[str, float] = field(default_factory=dict)
