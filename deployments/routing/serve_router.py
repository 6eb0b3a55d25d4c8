"""The Ray Serve adapter of our routing policies: a `RequestRouter` for an engine pool.

Serve runs one router per handle (in the ingress, for the decode or colocated pool; in the
disaggregated client, for prefill). For each request it turns Serve's view into plain records
(`ReplicaState`: Serve's queue-length cache for requests in flight, the replica's own report
from `record_routing_stats` for its engine's queue, KV usage and epoch) and asks the pure
policy; the chosen replica is ranked first and the rest follow in score order, so Serve falls
back to them if the first refuses. Calls that carry no prompt (health, stats, lease release)
go to the least loaded replica. Decisions are kept as counts by policy and reason, and the
latency of each decision, for `stats()`.

A request may arrive already routed (`EngineRequest.route_to`): the disaggregated client asks the
decode pool's router to `decide` before the prefill runs (so it can skip the prefill when that
replica holds the prompt), and the call then goes where that decision said, while the replica is
still a candidate. Routers register by pool name in their process for that lookup
(router_registry.py). Serve may run routers on their own event loop thread, so the policy, which keeps
state, is only called under a lock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from deployments.routing.block_hashes import prompt_block_hashes
from deployments.routing.policies import make_policy
from deployments.routing.router_registry import register
from deployments.routing.state import ReplicaState, RouteDecision, RoutingRequest

SESSION_KEY = "session_id"
ROUTE_TO_KEY = "route_to"


def routing_request(pending: PendingRequest | None, block_size: int, max_blocks: int) -> RoutingRequest | None:
    """The prompt of a generate/prefill call (an EngineRequest as the first argument), or None."""
    if pending is None or not pending.args:
        return None
    prompt = getattr(pending.args[0], "prompt_token_ids", None)
    if prompt is None:
        return None
    session = getattr(pending.args[0], SESSION_KEY, None)
    return RoutingRequest(prompt_block_hashes(prompt, block_size, max_blocks), session)


def replica_state(replica: RunningReplica, in_flight: int | None) -> ReplicaState:
    stats = replica.routing_stats or {}
    resident = stats.get("resident")
    return ReplicaState(replica.replica_id.unique_id, ongoing=in_flight or 0, queued=int(stats.get("waiting", 0)),
                        kv_usage=float(stats.get("kv_usage", 0.0)),
                        prompt_tokens_pending=int(stats.get("prompt_tokens_pending", 0)), reported_at_s=stats.get("at_s"),
                        epoch=str(stats.get("epoch", "")), resident=None if resident is None else tuple(resident))


def reported_block_size(replicas: list[RunningReplica], default: int) -> int:
    """The engines' own block size once they report their caches (the router's hashes must
    cut prompts where the engines do); the configured one before."""
    sizes = {int((r.routing_stats or {}).get("block_size") or 0) for r in replicas} - {0}
    return sizes.pop() if len(sizes) == 1 else default


class PolicyRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "prefix", block_size: int = 16, max_blocks: int = 4096,
                         pool: str = "engine", metrics: bool = True, **options: Any) -> None:
        from monitoring.exporter import MetricsExporter

        self.policy_name = policy
        self.pool = pool
        self._exporter = MetricsExporter(enabled=metrics)
        self._policy = make_policy(policy, **options)
        self._block_size = block_size
        self._max_blocks = max_blocks
        self.decisions: Counter[str] = Counter()
        self.decision_s: list[float] = []
        self._policy_lock = threading.Lock()
        register(pool, self)

    @property
    def block_size(self) -> int:
        return reported_block_size(list(self.curr_replicas.values()), self._block_size)

    def decide(self, prompt_token_ids: list[int], session_id: str | None = None) -> RouteDecision | None:
        """Route a request now, before it is sent (the caller carries the replica id in
        `EngineRequest.route_to`). None when no replica is known yet."""
        replicas = list(self.curr_replicas.values())
        if not replicas:
            return None
        cache = self.replica_queue_len_cache
        states = [replica_state(r, cache.get(r.replica_id)) for r in replicas]
        request = RoutingRequest(prompt_block_hashes(prompt_token_ids, self.block_size, self._max_blocks), session_id)
        return self._decide(request, states)

    def _decide(self, request: RoutingRequest, states: list[ReplicaState]) -> RouteDecision | None:
        started = time.perf_counter()
        with self._policy_lock:
            decision = self._policy.choose(request, states, time.time())
        if decision is not None:
            self.decisions[decision.reason] += 1
            self.decision_s.append(time.perf_counter() - started)
            del self.decision_s[:-10_000]
            self._export(decision, request)
        return decision

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        cache = self.replica_queue_len_cache
        states = [replica_state(r, cache.get(r.replica_id)) for r in candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        by_load = sorted(states, key=lambda s: (s.ongoing + s.queued, s.replica_id))
        routed_to = getattr(pending_request.args[0], ROUTE_TO_KEY, None) if pending_request and pending_request.args \
            else None
        if routed_to in by_id:  # the policy decided in decide(), counted there; this is its hand-over
            self.decisions["decided_before"] += 1
            return [[by_id[routed_to]], *([by_id[s.replica_id]] for s in by_load if s.replica_id != routed_to)]
        block_size = reported_block_size(candidate_replicas, self._block_size)
        request = routing_request(pending_request, block_size, self._max_blocks)
        if request is None:
            return [[by_id[s.replica_id]] for s in by_load]
        decision = self._decide(request, states)
        if decision is None:
            return [[by_id[s.replica_id]] for s in by_load]
        rest = sorted((s for s in states if s.replica_id != decision.replica_id),
                      key=lambda s: (-decision.scores.get(s.replica_id, 0.0), s.ongoing + s.queued, s.replica_id))
        return [[by_id[decision.replica_id]], *([by_id[s.replica_id]] for s in rest)]

    def _export(self, decision, request: RoutingRequest) -> None:
        from monitoring import metrics as m

        self._exporter.inc(m.ROUTING_DECISIONS, pool=self.pool, policy=self.policy_name, reason=decision.reason)
        self._exporter.inc(m.ROUTING_PROMPT_BLOCKS, request.blocks, pool=self.pool, kind="routed")
        self._exporter.inc(m.ROUTING_PROMPT_BLOCKS, decision.expected_hit_blocks, pool=self.pool, kind="expected_hit")
