"""Disaggregated requests: which decode, which prefill, and when to skip the remote prefill.

Rule (`local_prefill_reason` below; `disagg_client.DisaggregatedEngineClient` asks it only when
`kv_transfer.local_prefill_hit_fraction` is set, with `min_uncached_tokens` 0 and no pool hits
counted, so today the client skips a remote prefill only for decode's own cache; the rest of the
rule is what the function decides for the inputs it is given):
1. decode first, by its pool's policy (prefix-aware: the replica whose cache holds the longest
   prefix, within the load gate): decode is where the request lives longest and its history
   grows;
2. the prompt tokens neither decode's cache nor the KV pool holds are the `uncached` part;
   the remote prefill is skipped (decode computes them itself) when they are fewer than
   `min_uncached_tokens`, or when decode's own cache holds at least `local_hit_fraction` of
   the prompt: shipping a few blocks costs more than computing them where they are needed;
3. otherwise the prefill pool's own router picks the prefill replica (prefix-aware: what it
   holds beyond the pool, against its load). The pair is still chosen jointly: the cost of a
   pair is decode's term (its cache, its load) plus prefill's (the blocks it must compute, its
   queue) plus the transfer, and on a network where every prefill reaches every decode alike
   the transfer does not depend on the pair, so the best pair is the best decode with the best
   prefill. A topology where it does (prefill and decode on one node, RDMA rails) is where a
   pair score would differ; none of our layouts has one.
"""

from __future__ import annotations

from dataclasses import dataclass

from deployments.routing.state import RouteDecision


@dataclass(frozen=True)
class DisaggregationRule:
    min_uncached_tokens: int = 256
    local_hit_fraction: float = 0.8


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
