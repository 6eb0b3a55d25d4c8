"""Disaggregated requests: choose decode and prefill together, or skip the remote prefill.

Rule:
1. decode first, by its policy (prefix-aware: the replica whose cache holds the longest prefix,
   within the load gate): decode is where the request lives longest and its history grows;
2. the prompt tokens neither decode's cache nor the KV pool holds are the `uncached` part;
   the remote prefill is skipped (decode computes them itself) when they are fewer than
   `min_uncached_tokens`, or when decode's own cache holds at least `local_hit_fraction` of
   the prompt: shipping a few blocks costs more than computing them where they are needed;
3. otherwise prefill is the replica with the lowest cost = blocks it must compute (the prompt
   less the longer of its cached prefix and the pool's) + `queued_request_blocks` per request
   in its queue (Dynamo's KV router rule, with queued work priced in blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deployments.routing.policies import replica_load
from deployments.routing.prefix_index import PrefixIndex
from deployments.routing.state import ReplicaState, RouteDecision, RoutingRequest


@dataclass(frozen=True)
class DisaggregationRule:
    min_uncached_tokens: int = 256
    local_hit_fraction: float = 0.8
    queued_request_blocks: float = 8.0


def local_prefill_reason(decode: RouteDecision, prompt_tokens: int, block_size: int, pool_hit_blocks: int,
                         rule: DisaggregationRule) -> str | None:
    """Why decode should compute the prompt itself (rule 2 above), or None for a remote prefill."""
    cached_blocks = max(decode.expected_hit_blocks, pool_hit_blocks)
    uncached = max(prompt_tokens - cached_blocks * block_size, 0)
    if uncached < rule.min_uncached_tokens:
        return "short_uncached"
    if decode.expected_hit_blocks * block_size >= rule.local_hit_fraction * prompt_tokens:
        return "decode_holds_prefix"
    return None


@dataclass(frozen=True)
class PairDecision:
    decode: RouteDecision
    prefill: RouteDecision | None  # None: decode computes the prompt itself
    reason: str  # remote_prefill | short_uncached | decode_holds_prefix | no_prefill_replica
    uncached_tokens: int


class PairRouter:
    def __init__(self, decode_policy, block_size: int, rule: DisaggregationRule = DisaggregationRule(),
                 prefill_capacity_blocks: int = 4096, stale_after_s: float = 30.0):
        self.decode_policy = decode_policy
        self.block_size = block_size
        self.rule = rule
        self.prefill_index = PrefixIndex(prefill_capacity_blocks)
        self.stale_after_s = stale_after_s

    def choose(self, request: RoutingRequest, prompt_tokens: int, decodes: Sequence[ReplicaState],
               prefills: Sequence[ReplicaState], pool_hit_blocks: int, now_s: float) -> PairDecision | None:
        decode = self.decode_policy.choose(request, decodes, now_s)
        if decode is None:
            return None
        uncached = max(prompt_tokens - max(decode.expected_hit_blocks, pool_hit_blocks) * self.block_size, 0)
        local = local_prefill_reason(decode, prompt_tokens, self.block_size, pool_hit_blocks, self.rule)
        if local is not None:
            return PairDecision(decode, None, local, uncached)
        prefill = self._choose_prefill(request, prefills, pool_hit_blocks, now_s)
        if prefill is None:
            return PairDecision(decode, None, "no_prefill_replica", uncached)
        return PairDecision(decode, prefill, "remote_prefill", uncached)

    def _choose_prefill(self, request: RoutingRequest, prefills: Sequence[ReplicaState], pool_hit_blocks: int,
                        now_s: float) -> RouteDecision | None:
        if not prefills:
            return None
        self.prefill_index.sync((r.replica_id for r in prefills), {r.replica_id: r.epoch for r in prefills})
        costs, hits = {}, {}
        for replica in prefills:
            rid = replica.replica_id
            hits[rid] = self.prefill_index.hit_blocks(rid, request.block_hashes)
            compute_blocks = request.blocks - max(hits[rid], pool_hit_blocks)
            costs[rid] = compute_blocks + self.rule.queued_request_blocks * replica_load(replica, now_s, self.stale_after_s)
        chosen = min(costs, key=lambda rid: (costs[rid], rid))
        self.prefill_index.record_routed(chosen, request.block_hashes)
        return RouteDecision(chosen, "prefix" if hits[chosen] else "least_loaded", hits[chosen],
                             {rid: -cost for rid, cost in costs.items()})
