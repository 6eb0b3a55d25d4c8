"""The manifest's routing and admission sections.

Admission: how many requests may wait for the engines before the
ingress answers 429 at once (a bounded queue, never an unbounded one or a storm of timeouts)."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class AdmissionSpec(_Strict):
    enabled: bool = True
    """Bound the requests in flight; off: every request is accepted and waits as long as it must."""
    max_queued_per_replica: Annotated[int, Field(ge=0, le=100_000)] = 32
    """Requests allowed to wait per engine replica of the serving pool (decode or colocated),
    beyond the `engine.max_num_seqs` it runs at once. Past the bound: HTTP 429 with Retry-After."""
    priority_header: Annotated[str, Field(pattern=r"^[A-Za-z0-9-]+$")] = "X-Priority"
    """Request header naming the priority class (high, normal, low; absent: normal). Low priority
    may fill only half the queue, so it is shed first under overload."""
    max_retry_after_s: Annotated[float, Field(ge=1, le=3600)] = 30.0
    """Longest Retry-After the ingress suggests (it estimates the drain time from the recent
    completion rate)."""
    max_prompt_tokens_per_replica: Annotated[int, Field(ge=1, le=1 << 30)] | None = None
    """Prompt tokens allowed in flight per engine replica of the serving pool, counted with the
    requests: past it, HTTP 429 (a request alone is always admitted). Set it where prompts range
    from a few tokens to tens of thousands: a request count alone admits a hundred 32k-token
    prompts as readily as a hundred short ones. None: requests are counted, not their tokens."""

    def limits_per_ingress(self, serving_pool, ingress_replicas: int) -> dict:
        """The bound each ingress replica enforces (each keeps its own count): the serving pool's
        capacity at its largest size, split evenly over the ingress replicas."""
        replicas = serving_pool.autoscaling.max_replicas if serving_pool.autoscaling else serving_pool.replicas
        engines = replicas * serving_pool.ranks_per_replica
        tokens = self.max_prompt_tokens_per_replica
        return {"max_running": math.ceil(engines * serving_pool.engine.max_num_seqs / ingress_replicas),
                "max_queued": math.ceil(engines * self.max_queued_per_replica / ingress_replicas),
                "max_retry_s": self.max_retry_after_s,
                "max_prompt_tokens": None if tokens is None else math.ceil(engines * tokens / ingress_replicas)}


class RoutingSpec(_Strict):
    """How requests pick a replica of this pool (deployments/routing/policies.py states each rule)."""

    policy: Literal["serve_default", "round_robin", "least_loaded", "prefix"] = "serve_default"
    """serve_default: Ray Serve's power of two choices on queue length; round_robin; least_loaded
    (power of two choices on our counts plus the engine's reported queue); prefix: cache- and
    load-aware (the replica holding the longest prefix of the prompt, within the load gate)."""
    imbalance_abs: Annotated[float, Field(ge=0)] = 8
    """prefix: the load gate opens (least loaded wins) when loads differ by more than this many
    requests and by more than `imbalance_rel` times."""
    imbalance_rel: Annotated[float, Field(ge=1)] = 1.5
    session_slack: Annotated[float, Field(ge=0)] = 4
    """prefix: a session stays on its replica while that one carries at most this many requests
    more than the least loaded."""
    pool_hit_value: Annotated[float, Field(ge=0, le=1)] = 0.8
    """prefix, with kv_pool enabled: what a prompt block the KV pool holds is worth on a replica
    that does not hold it, as a fraction of a local cache hit (loading it beats computing it but
    is not free). 0 ignores the pool; 1 treats a pool hit as a local one."""
    kv_events: bool = True
    """prefix: each engine publishes its prefix cache's stores and evictions (vLLM KV events) and
    its replica reports the cache to the routers, so routing sees what engines really hold;
    off: the routers estimate it from what they sent where. Needs engine.enable_prefix_caching."""
    stats_period_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    """How often each replica reports its engine's queue, KV usage and epoch to the routers."""
    prompt_tokens_per_request: Annotated[int, Field(ge=0, le=1 << 24)] = 4096
    """least_loaded and prefix: a replica's load also counts the prompt tokens its engine has yet
    to prefill (from its report), one request per this many tokens, so a 32k-token prompt in a
    queue weighs as eight requests and a 100-token one as almost nothing. 0: requests only."""

    def router_kwargs(self, pool: str, block_size: int, capacity_blocks: int, metrics: bool = True,
                      pool_capacity_blocks: int = 0) -> dict:
        """`pool_capacity_blocks`: the KV pool's capacity in blocks of this pool's size (0: no pool)."""
        options = {"policy": self.policy, "block_size": block_size, "pool": pool, "metrics": metrics}
        if self.policy in ("least_loaded", "prefix"):
            options["prompt_tokens_per_request"] = self.prompt_tokens_per_request
        if self.policy == "prefix":
            options.update(capacity_blocks=capacity_blocks, imbalance_abs=self.imbalance_abs,
                           imbalance_rel=self.imbalance_rel, session_slack=self.session_slack)
            if pool_capacity_blocks > 0 and self.pool_hit_value > 0:
                options.update(pool_capacity_blocks=pool_capacity_blocks, pool_hit_value=self.pool_hit_value)
        return options
