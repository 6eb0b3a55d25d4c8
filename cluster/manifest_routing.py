"""The manifest's admission section: how many requests may wait for the engines before the
ingress answers 429 at once (a bounded queue, never an unbounded one or a storm of timeouts)."""

from __future__ import annotations

import math
from typing import Annotated

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

    def limits_per_ingress(self, serving_pool, ingress_replicas: int) -> dict:
        """The bound each ingress replica enforces (each keeps its own count): the serving pool's
        capacity at its largest size, split evenly over the ingress replicas."""
        replicas = serving_pool.autoscaling.max_replicas if serving_pool.autoscaling else serving_pool.replicas
        engines = replicas * serving_pool.ranks_per_replica
        return {"max_running": math.ceil(engines * serving_pool.engine.max_num_seqs / ingress_replicas),
                "max_queued": math.ceil(engines * self.max_queued_per_replica / ingress_replicas),
                "max_retry_s": self.max_retry_after_s}
