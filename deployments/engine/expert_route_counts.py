"""Cumulative (token, expert) counts of the experts one vLLM worker holds: tensor code, no vLLM.

Counting rule: one per (token, top-k slot) whose expert this worker holds, by global expert id
(the physical slot id when EPLB replicates experts), summed over MoE layers. The counts live in
one int64 tensor per device, `[num_experts + 1]`, whose last entry swallows the routes to
experts held elsewhere. They are updated only in place, with fixed shapes and no host sync, so
the same code runs on CPU and inside a captured CUDA graph: every replay adds to the same
memory. Reading them (`snapshot`) is the only host copy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def held_route_targets(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """Counter index of every (token, slot): its global expert id when this worker holds that
    expert, else `num_experts` (the discard entry). `expert_map`: global -> local id, -1 where
    another rank holds it; None when this worker holds every expert."""
    ids = topk_ids.reshape(-1).long()  # [M * k]
    valid = (ids >= 0) & (ids < num_experts)  # dispatchers may leave -1 in empty slots
    safe = torch.where(valid, ids, 0)  # [M * k], a legal index everywhere
    if expert_map is not None:
        valid = valid & (expert_map[safe] >= 0)
    return torch.where(valid, safe, num_experts)  # [M * k]


def local_expert_owners(expert_map: torch.Tensor | None, local_num_experts: int, device: torch.device) -> torch.Tensor:
    """Global expert id of each local expert slot: the inverse of `expert_map`.

    Each held slot appears once in the map, so the id is the sum over a one-hot match; no
    scatter with colliding indices, no data-dependent shape."""
    local = torch.arange(local_num_experts, device=device)  # [L]
    if expert_map is None:
        return local
    matches = expert_map.to(device).long().unsqueeze(0) == local.unsqueeze(1)  # [L, E]
    global_ids = torch.arange(expert_map.numel(), device=device)  # [E]
    return (matches * global_ids).sum(dim=1)  # [L]


def stream_is_capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class RouteCounters:
    """One worker's counts, per (device, num_experts). `is_capturing(device)` says whether a
    CUDA graph is being captured there: a counter created during a capture would have its
    zero-fill captured too and be reset by every replay, so it is created only outside one
    (vLLM's eager profile run reaches every MoE layer before any capture)."""

    def __init__(self, is_capturing: Callable[[torch.device], bool] = stream_is_capturing):
        self._is_capturing = is_capturing
        self._counts: dict[tuple[str, int], torch.Tensor] = {}

    def _counter(self, device: torch.device, num_experts: int) -> torch.Tensor | None:
        counts = self._counts.get((str(device), num_experts))
        if counts is None and not self._is_capturing(device):
            counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)  # [E + 1]
            self._counts[(str(device), num_experts)] = counts
        return counts

    def add_routes(self, topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int) -> bool:
        """Count dispatched routes `topk_ids` ([M, k] global ids). False when no counter exists
        yet and none can be made (inside a capture)."""
        counts = self._counter(topk_ids.device, num_experts)
        if counts is None:
            return False
        targets = held_route_targets(topk_ids, expert_map, num_experts)  # [M * k]
        counts.scatter_add_(0, targets, torch.ones_like(targets))
        return True

    def add_expert_tokens(self, expert_num_tokens: torch.Tensor, expert_map: torch.Tensor | None,
                          num_experts: int) -> bool:
        """Count tokens per local expert slot (`[L]`, as batched dispatchers report them instead
        of per-token ids). Same return as `add_routes`."""
        counts = self._counter(expert_num_tokens.device, num_experts)
        if counts is None:
            return False
        owners = local_expert_owners(expert_map, expert_num_tokens.numel(), counts.device)  # [L]
        counts.scatter_add_(0, owners, expert_num_tokens.reshape(-1).to(torch.int64))
        return True

    def snapshot(self) -> dict[int, int]:
        """Global expert id -> count, for the experts with any; summed over devices."""
        total: dict[int, int] = {}
        for counts in self._counts.values():
            for expert, count in enumerate(counts[:-1].tolist()):
                if count:
                    total[expert] = total.get(expert, 0) + int(count)
        return dict(sorted(total.items()))
