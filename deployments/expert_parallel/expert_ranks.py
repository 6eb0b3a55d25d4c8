"""Pure rules of an expert-parallel engine group: each rank's engine arguments, and which rank
takes the next request. No Ray, no vLLM: plain data in, plain data out.

A group is N vLLM engines in vLLM's external-load-balancing data-parallel mode: every rank is
its own AsyncLLM with `data_parallel_rank` set, attention runs data-parallel (each rank its own
requests and KV cache) and the MoE layers expert-parallel (each rank 1/N of the routed experts,
tokens exchanged by collectives). Rank 0's process also runs vLLM's DP coordinator, which wakes
idle ranks so that they join every MoE collective with dummy batches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

CPU_COMPAT_EXTENSION = "deployments.engine.vllm_cpu_ep_compat.CpuExpertParallelCompat"


def rank_engine_spec(engine: Mapping[str, Any], *, size: int, rank: int, address: str, rpc_port: int,
                     accelerator: str, enable_eplb: bool = False, num_redundant_experts: int = 0) -> dict[str, Any]:
    """The pool's engine settings for one rank: the same on every rank except `rank`.

    `distributed_executor_backend` is set explicitly because inside a Ray placement group
    vLLM would otherwise pick its Ray executor and try to schedule its own workers.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside a group of {size}")
    extra = dict(engine.get("extra_args") or {})
    extra.update(
        data_parallel_size=size,
        data_parallel_rank=rank,
        data_parallel_address=address,
        data_parallel_rpc_port=rpc_port,
        data_parallel_backend="mp",
        distributed_executor_backend="mp",
        enable_expert_parallel=True,
    )
    if accelerator == "cpu":
        # vLLM 0.32's CPU build lacks two pieces of the DP+EP path; the shim supplies them.
        extra["worker_extension_cls"] = CPU_COMPAT_EXTENSION
    if enable_eplb:
        extra["enable_eplb"] = True
        extra["eplb_config"] = {"num_redundant_experts": num_redundant_experts}
    return {**engine, "extra_args": extra}


def pick_rank(in_flight: Sequence[int]) -> int:
    """The rank with the fewest requests in flight (lowest rank on ties).

    Every rank runs the whole attention for its own requests, so balancing request counts
    balances KV memory and per-step batch size; expert work is spread by the collectives
    whatever the choice.
    """
    if not in_flight:
        raise ValueError("a group has at least one rank")
    return min(range(len(in_flight)), key=lambda rank: (in_flight[rank], rank))


def merge_expert_load(per_rank: Sequence[Mapping[int, int]]) -> dict[int, int]:
    """Routed-token counts per global expert id, summed over ranks.

    Each expert lives on exactly one rank (no redundant experts on CPU), so the sum counts
    every (token, expert) assignment once.
    """
    total: dict[int, int] = {}
    for counts in per_rank:
        for expert, tokens in counts.items():
            total[int(expert)] = total.get(int(expert), 0) + int(tokens)
    return dict(sorted(total.items()))
