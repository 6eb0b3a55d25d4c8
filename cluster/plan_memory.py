"""Memory per rank: weights, KV cache and the tokens of KV it holds; the fit check. Pure.

Rule. A rank is one engine process on one device: an expert-parallel rank (data-parallel
attention) holds every dense weight plus 1/size of the routed experts; a tensor-parallel rank
holds 1/tp of all weights. On GPU, vLLM gives the KV cache what is left of
`memory x gpu_memory_utilization` after the weights, less its activation workspace (measured
at start-up, not known here), so the tokens shown are an upper bound. On CPU the KV cache is
`cpu_kvcache_space_gib` of host memory and the weights live outside it.

KV bytes per token on a rank: MLA caches one latent per token and layer, replicated on every
tensor-parallel rank; GQA splits its KV heads over tensor-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

# What the driver reports (nvidia-smi "MiB" total) for the accelerators GPU manifests name,
# by the `accelerator-type` node label; `placement.accelerator_memory_gib` overrides it.
ACCELERATOR_MEMORY_GIB = {
    "H200": 143_771 / 1024,  # 141 GB HBM3e
    "H100": 81_559 / 1024,  # 80 GB HBM3
    "A100-80G": 81_920 / 1024,
}
ACCELERATOR_LABEL = "accelerator-type"
GIB = 1 << 30


@dataclass(frozen=True)
class RankMemory:
    """One rank of a pool (all ranks of a pool are alike)."""

    weight_bytes: int
    usable_bytes: int | None  # GPU: memory x utilization; None on CPU (weights outside the KV space)
    kv_cache_bytes: int  # upper bound on GPU (activation workspace not subtracted)
    kv_bytes_per_token: int
    device_memory_bytes: int | None = None

    @property
    def kv_tokens(self) -> int:
        return self.kv_cache_bytes // self.kv_bytes_per_token if self.kv_bytes_per_token > 0 else 0

    @property
    def fits(self) -> bool:
        return self.usable_bytes is None or self.weight_bytes < self.usable_bytes


def accelerator_memory_gib(node_labels: dict[str, str], override_gib: float | None) -> float | None:
    if override_gib is not None:
        return override_gib
    return ACCELERATOR_MEMORY_GIB.get(node_labels.get(ACCELERATOR_LABEL, ""))


def weights_per_rank(weight_bytes: int, expert_bytes: int, ep_size: int, tp_size: int) -> int:
    dense = weight_bytes - expert_bytes
    return -(-(dense + -(-expert_bytes // ep_size)) // tp_size)


def rank_memory(*, weight_bytes: int, expert_bytes: int, kv_bytes_per_token: int, ep_size: int, tp_size: int,
                gpu: bool, memory_gib: float | None, utilization: float, cpu_kv_gib: float) -> RankMemory:
    weights = weights_per_rank(weight_bytes, expert_bytes, ep_size, tp_size)
    if not gpu:
        return RankMemory(weights, None, int(cpu_kv_gib * GIB), kv_bytes_per_token)
    if memory_gib is None:
        return RankMemory(weights, None, 0, kv_bytes_per_token)
    device = int(memory_gib * GIB)
    usable = int(device * utilization)
    return RankMemory(weights, usable, max(usable - weights, 0), kv_bytes_per_token, device)


def smallest_fitting_split(weight_bytes: int, expert_bytes: int, num_experts: int | None, usable_bytes: int,
                           ep_size: int, tp_size: int) -> int | None:
    """The smallest expert-parallel size (dividing the experts) at which a rank's weights fit."""
    if not num_experts:
        return None
    for size in range(max(ep_size, 1) + 1, num_experts + 1):
        if num_experts % size == 0 and weights_per_rank(weight_bytes, expert_bytes, size, tp_size) < usable_bytes:
            return size
    return None
