"""Pure rules of an expert-parallel engine group: each rank's engine arguments, and which rank
takes the next request. No Ray, no vLLM: plain data in, plain data out.

A group is N vLLM engines in vLLM's external-load-balancing data-parallel mode: every rank is
its own AsyncLLM with `data_parallel_rank` set, attention runs data-parallel (each rank its own
requests and KV cache) and the MoE layers expert-parallel (each rank 1/N of the routed experts,
tokens exchanged by collectives). Rank 0's process also runs vLLM's DP coordinator, which wakes
idle ranks so that they join every MoE collective with dummy batches.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from deployments.records import ServerStats

# vLLM's worker_extension_cls (one per engine): the observation methods every rank answers
# (held experts, routed-token counts, weight bytes); on CPU inside the shim's class, which adds
# what vLLM 0.32's CPU build lacks for the DP+EP path.
OBSERVATION_EXTENSION = "deployments.engine.expert_observation.ExpertObservation"
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
    extension = CPU_COMPAT_EXTENSION if accelerator == "cpu" else OBSERVATION_EXTENSION
    if extra.get("worker_extension_cls") not in (None, "", extension):
        raise ValueError(
            f"engine.extra_args.worker_extension_cls={extra['worker_extension_cls']!r}: an expert-parallel "
            f"pool's ranks need {extension} (vLLM takes one extension class, and the group reads its "
            "experts' load through it); drop the setting"
        )
    extra.update(
        data_parallel_size=size,
        data_parallel_rank=rank,
        data_parallel_address=address,
        data_parallel_rpc_port=rpc_port,
        data_parallel_backend="mp",
        distributed_executor_backend="mp",
        enable_expert_parallel=True,
        worker_extension_cls=extension,
    )
    if enable_eplb:
        extra["enable_eplb"] = True
        extra["eplb_config"] = {"num_redundant_experts": num_redundant_experts}
    return {**engine, "extra_args": extra}


# A rank holding a longer prefix of the prompt takes the request while it has at most this many
# requests in flight beyond the least loaded rank (the pools' routing.session_slack default):
# reusing a cached prefix saves its prefill, but not at the price of one rank's queue growing.
RANK_AFFINITY_SLACK = 4


def pick_rank(in_flight: Sequence[int], hit_blocks: Sequence[int] | None = None,
              slack: int = RANK_AFFINITY_SLACK) -> int:
    """The rank that takes the next request.

    Every rank runs the whole attention for its own requests with its own KV cache (expert
    work is spread by the collectives whatever the choice). So: among the ranks within `slack`
    requests of the least loaded, the one whose prefix cache holds the most leading blocks of
    the prompt (`hit_blocks`, per rank; None when the group does not follow its ranks' caches);
    then the fewest in flight, which balances KV memory and per-step batch size; then the
    lowest rank.
    """
    if not in_flight:
        raise ValueError("a group has at least one rank")
    if hit_blocks is not None and len(hit_blocks) != len(in_flight):
        raise ValueError(f"{len(hit_blocks)} hit counts for {len(in_flight)} ranks")
    hits = hit_blocks or [0] * len(in_flight)
    floor = min(in_flight)
    eligible = [rank for rank in range(len(in_flight)) if in_flight[rank] <= floor + slack]
    return min(eligible, key=lambda rank: (-hits[rank], in_flight[rank], rank))


def leading_hits(prompt_hashes: Sequence[int], resident: Collection[int]) -> int:
    """How many of the prompt's leading blocks (chained hashes) a cache holds: a block is only
    reusable if every block before it is too."""
    count = 0
    for block in prompt_hashes:
        if block not in resident:
            break
        count += 1
    return count


def merge_routing_stats(per_rank: Sequence[Mapping[str, Any] | None]) -> dict[str, Any]:
    """The group's report to the pool's request router (LLMServer.record_routing_stats, one per
    rank; None for a rank that did not answer in time): in flight, waiting and prompt tokens
    pending summed, KV usage
    the mean, the resident prefix blocks the union (a request the router sends to the group
    reaches the rank holding its prefix, pick_rank). The epoch changes when any rank's does: a
    restarted rank has an empty cache. A rank that did not answer contributes nothing."""
    answered = [stats for stats in per_rank if stats]
    merged: dict[str, Any] = {
        "epoch": "group[" + ",".join(str(stats.get("epoch")) if stats else "?" for stats in per_rank) + "]",
        "in_flight": sum(int(stats.get("in_flight", 0)) for stats in answered),
        "at_s": min((stats["at_s"] for stats in answered if "at_s" in stats), default=None),
    }
    if any("waiting" in stats for stats in answered):
        merged["waiting"] = sum(int(stats.get("waiting", 0)) for stats in answered)
    if any("prompt_tokens_pending" in stats for stats in answered):
        merged["prompt_tokens_pending"] = sum(int(stats.get("prompt_tokens_pending", 0)) for stats in answered)
    usage = [float(stats["kv_usage"]) for stats in answered if stats.get("kv_usage") is not None]
    if usage:
        merged["kv_usage"] = sum(usage) / len(usage)
    block_sizes = {stats["block_size"] for stats in answered if stats.get("block_size") is not None}
    if len(block_sizes) == 1:  # ranks share one engine configuration; anything else reports nothing
        merged["block_size"] = block_sizes.pop()
        resident: dict[int, None] = {}
        for stats in answered:
            resident.update(dict.fromkeys(stats.get("resident", ())))
        merged["resident"] = list(resident)
    if merged["at_s"] is None:
        del merged["at_s"]
    return merged


def merge_expert_load(per_rank: Sequence[Mapping[int, int]]) -> dict[int, int]:
    """Routed-token counts per global expert id, summed over ranks.

    Each id lives on exactly one rank (with EPLB the ids are physical slots, and a redundant
    replica has its own slot), so the sum counts every (token, expert) assignment once.
    """
    total: dict[int, int] = {}
    for counts in per_rank:
        for expert, tokens in counts.items():
            total[int(expert)] = total.get(int(expert), 0) + int(tokens)
    return dict(sorted(total.items()))


def group_stats(per_rank: list[ServerStats], expert_load: dict[int, int]) -> ServerStats:
    """One ServerStats for the group: counters summed over ranks, each rank kept in `ranks`."""
    total = ServerStats(replica_id="group[" + ",".join(s.replica_id for s in per_rank) + "]")
    for stats in per_rank:
        total.started_total += stats.started_total
        total.finished_total += stats.finished_total
        total.aborted_total += stats.aborted_total
        total.failed_total += stats.failed_total
        total.in_flight_request_ids += stats.in_flight_request_ids
        total.engine_unfinished_requests += stats.engine_unfinished_requests
        for key, value in stats.kv_transfer.items():
            if isinstance(value, (int, float)):
                total.kv_transfer[key] = total.kv_transfer.get(key, 0) + value
    total.in_flight_request_ids.sort()
    total.ranks = per_rank
    total.routed_tokens_per_expert = expert_load
    return total
