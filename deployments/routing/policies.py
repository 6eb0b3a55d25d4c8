"""Routing policies: which engine replica serves a request. Pure: plain data and `now_s` in.

round_robin   replicas in turn (a baseline).
least_loaded  power of two choices on load (Serve's default rule, here on our own counts).
prefix        cache- and load-aware. Rule, in order:
  1. load gate (SGLang's rule): if the most and least loaded replicas differ by more than
     `imbalance_abs` requests and by more than `imbalance_rel` times, the least loaded wins,
     whatever it holds: a cache hit is not worth a queue;
  2. session affinity: a request whose session is pinned goes to its replica unless that one
     carries more than `session_slack` requests above the least loaded;
  3. otherwise the highest score wins, score = w_prefix * hit_fraction - w_kv * kv_usage
     - w_queue * load / max_load (llm-d's precise scorer weights: 2, 1, 1); ties go to the
     lower load, then in turn.
  With a KV pool (`pool_capacity_blocks` > 0) a prefix the pool holds can be loaded by any
  replica instead of computed, so in rule 3 it counts on every replica as `pool_hit_value` of a
  local hit (a load is cheaper than compute, not free): affinity then only pays for what a
  replica holds beyond the pool, and load decides sooner. What the pool holds is estimated
  like a replica's cache: every prompt routed and every block an engine reported (engines
  store what they computed when a request ends), least recent evicted first past its capacity.
  Load = requests this router has in flight there + the queue the replica last reported, if that
  report is younger than `stale_after_s` (a stale report counts as unknown, not as idle), + the
  prompt tokens that report says are still to prefill, one request per `prompt_tokens_per_request`
  (least_loaded and prefix): one 32k-token prompt is not one short request.
  What a replica holds: its engine's own report (`ReplicaState.resident`, from vLLM's KV cache
  events) when it sends one, else the router's estimate from what it routed there
  (prefix_index.py); either is emptied when the replica's epoch changes (engine restarted).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from deployments.routing.prefix_index import PrefixIndex
from deployments.routing.state import ReplicaState, RouteDecision, RoutingRequest

POOL = "<kv pool>"  # the pool's entry in its PrefixIndex


def replica_load(replica: ReplicaState, now_s: float, stale_after_s: float,
                 prompt_tokens_per_request: int = 0) -> float:
    fresh = replica.reported_at_s is not None and now_s - replica.reported_at_s <= stale_after_s
    if not fresh:
        return replica.ongoing
    tokens = replica.prompt_tokens_pending / prompt_tokens_per_request if prompt_tokens_per_request > 0 else 0.0
    return replica.ongoing + replica.queued + tokens


def fresh_kv_usage(replica: ReplicaState, now_s: float, stale_after_s: float) -> float:
    fresh = replica.reported_at_s is not None and now_s - replica.reported_at_s <= stale_after_s
    return replica.kv_usage if fresh else 0.0


class RoundRobin:
    name = "round_robin"

    def __init__(self, **_: object):
        self._next = 0

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState], now_s: float) -> RouteDecision | None:
        if not replicas:
            return None
        ordered = sorted(replicas, key=lambda r: r.replica_id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return RouteDecision(chosen.replica_id, "round_robin")


class LeastLoaded:
    name = "least_loaded"

    def __init__(self, stale_after_s: float = 30.0, seed: int | None = None, prompt_tokens_per_request: int = 0,
                 **_: object):
        self.stale_after_s = stale_after_s
        self.prompt_tokens_per_request = prompt_tokens_per_request
        self._rng = random.Random(seed)

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState], now_s: float) -> RouteDecision | None:
        if not replicas:
            return None
        pair = self._rng.sample(list(replicas), k=min(2, len(replicas)))
        chosen = min(pair, key=lambda r: (replica_load(r, now_s, self.stale_after_s, self.prompt_tokens_per_request),
                                          r.replica_id))
        return RouteDecision(chosen.replica_id, "least_loaded" if len(replicas) > 1 else "only_replica")


@dataclass(frozen=True)
class PrefixWeights:
    prefix: float = 2.0
    kv: float = 1.0
    queue: float = 1.0


class PrefixAware:
    name = "prefix"

    def __init__(self, capacity_blocks: int = 4096, weights: PrefixWeights = PrefixWeights(),
                 imbalance_abs: float = 8, imbalance_rel: float = 1.5, session_slack: float = 4,
                 stale_after_s: float = 30.0, max_sessions: int = 100_000, pool_capacity_blocks: int = 0,
                 pool_hit_value: float = 0.8, prompt_tokens_per_request: int = 0, **_: object):
        self.index = PrefixIndex(capacity_blocks)
        self.pool = PrefixIndex(pool_capacity_blocks) if pool_capacity_blocks > 0 else None
        self.pool_hit_value = pool_hit_value
        self.weights = weights
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self.session_slack = session_slack
        self.stale_after_s = stale_after_s
        self.prompt_tokens_per_request = prompt_tokens_per_request
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._max_sessions = max_sessions
        self._turn = 0
        self._reported: dict[str, float | None] = {}  # the report each index entry was last replaced from

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaState], now_s: float) -> RouteDecision | None:
        if not replicas:
            return None
        self.index.sync((r.replica_id for r in replicas), {r.replica_id: r.epoch for r in replicas})
        for replica in replicas:
            if replica.resident is not None and self._reported.get(replica.replica_id) != replica.reported_at_s:
                # A fresh report from the engine's KV events: exact where the estimate guessed.
                self._reported[replica.replica_id] = replica.reported_at_s
                self.index.replace(replica.replica_id, replica.resident)
                if self.pool is not None:
                    self.pool.record_routed(POOL, replica.resident)
        loads = {r.replica_id: replica_load(r, now_s, self.stale_after_s, self.prompt_tokens_per_request)
                 for r in replicas}
        hits = {r.replica_id: self.index.hit_blocks(r.replica_id, request.block_hashes) for r in replicas}
        pooled = self.pool.hit_blocks(POOL, request.block_hashes) if self.pool is not None else 0
        decision = (self._load_gate(replicas, loads, hits) or self._session(request, loads, hits)
                    or self._best_score(request, replicas, loads, hits, pooled, now_s))
        self.index.record_routed(decision.replica_id, request.block_hashes)
        if self.pool is not None:
            self.pool.record_routed(POOL, request.block_hashes)
        if request.session_id is not None:
            self._sessions[request.session_id] = decision.replica_id
            self._sessions.move_to_end(request.session_id)
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return decision

    def _load_gate(self, replicas, loads: dict[str, float], hits: dict[str, int]) -> RouteDecision | None:
        low, high = min(loads.values()), max(loads.values())
        if high - low > self.imbalance_abs and high > self.imbalance_rel * low:
            chosen = min(replicas, key=lambda r: (loads[r.replica_id], -hits[r.replica_id], r.replica_id))
            return RouteDecision(chosen.replica_id, "load_gate", hits[chosen.replica_id])
        return None

    def _session(self, request: RoutingRequest, loads: dict[str, float], hits: dict[str, int]) -> RouteDecision | None:
        pinned = self._sessions.get(request.session_id) if request.session_id is not None else None
        if pinned in loads and loads[pinned] <= min(loads.values()) + self.session_slack:
            return RouteDecision(pinned, "session", hits[pinned])
        return None

    def _best_score(self, request, replicas, loads, hits, pooled: int, now_s: float) -> RouteDecision:
        max_load = max(max(loads.values()), 1.0)
        scores = {}
        for replica in replicas:
            rid = replica.replica_id
            cached = hits[rid] + self.pool_hit_value * max(0, pooled - hits[rid])
            hit_fraction = cached / request.blocks if request.blocks else 0.0
            scores[rid] = (self.weights.prefix * hit_fraction
                           - self.weights.kv * fresh_kv_usage(replica, now_s, self.stale_after_s)
                           - self.weights.queue * loads[rid] / max_load)
        best = max(scores.values())
        tied = sorted((rid for rid, score in scores.items() if best - score < 1e-9), key=lambda rid: (loads[rid], rid))
        tied = [rid for rid in tied if loads[rid] == loads[tied[0]]]
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        reason = ("prefix" if hits[chosen] > 0 else "only_replica" if len(replicas) == 1
                  else "pool_prefix" if pooled > 0 else "least_loaded")
        return RouteDecision(chosen, reason, hits[chosen], scores)


POLICIES = {cls.name: cls for cls in (RoundRobin, LeastLoaded, PrefixAware)}


def make_policy(name: str, **options: object):
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return cls(**options)
