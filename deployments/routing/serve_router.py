"""The Ray Serve adapter of our routing policies: a `RequestRouter` for an engine pool.

Serve runs one router per handle (in the ingress, for the decode or colocated pool; in the
disaggregated client, for prefill). For each request it turns Serve's view into plain records
(`ReplicaState`: Serve's queue-length cache for requests in flight, the replica's own report
from `record_routing_stats` for its engine's queue, KV usage and epoch) and asks the pure
policy; the chosen replica is ranked first and the rest follow in score order, so Serve falls
back to them if the first refuses. Calls that carry no prompt (health, stats, lease release)
go to the least loaded replica. Decisions are kept as counts by policy and reason, and the
latency of each decision, for `stats()`.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from deployments.routing.block_hashes import prompt_block_hashes
from deployments.routing.policies import make_policy
from deployments.routing.state import ReplicaState, RoutingRequest

SESSION_KEY = "session_id"


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
                        kv_usage=float(stats.get("kv_usage", 0.0)), reported_at_s=stats.get("at_s"),
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

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        started = time.perf_counter()
        cache = self.replica_queue_len_cache
        states = [replica_state(r, cache.get(r.replica_id)) for r in candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        block_size = reported_block_size(candidate_replicas, self._block_size)
        request = routing_request(pending_request, block_size, self._max_blocks)
        if request is None:
            ranked = sorted(states, key=lambda s: (s.ongoing + s.queued, s.replica_id))
            return [[by_id[s.replica_id]] for s in ranked]
        decision = self._policy.choose(request, states, time.time())
        self.decisions[decision.reason] += 1
        self.decision_s.append(time.perf_counter() - started)
        del self.decision_s[:-10_000]
        self._export(decision, request)
        rest = sorted((s for s in states if s.replica_id != decision.replica_id),
                      key=lambda s: (-decision.scores.get(s.replica_id, 0.0), s.ongoing + s.queued, s.replica_id))
        return [[by_id[decision.replica_id]], *([by_id[s.replica_id]] for s in rest)]

    def _export(self, decision, request: RoutingRequest) -> None:
        from monitoring import metrics as m

        self._exporter.inc(m.ROUTING_DECISIONS, pool=self.pool, policy=self.policy_name, reason=decision.reason)
        self._exporter.inc(m.ROUTING_PROMPT_BLOCKS, request.blocks, pool=self.pool, kind="routed")
        self._exporter.inc(m.ROUTING_PROMPT_BLOCKS, decision.expected_hit_blocks, pool=self.pool, kind="expected_hit")
