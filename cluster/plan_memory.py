"""Memory per rank: weights, KV cache and the tokens of KV it holds; the fit check. Pure.

Rule. A rank is one engine process on one device: an expert-parallel rank (data-parallel
attention) holds every dense weight plus 1/size of the routed experts; a tensor-parallel rank
holds 1/tp of all weights. On GPU, vLLM gives the KV cache what is left of
`memory x gpu_memory_utilization` after the weights, less its activation workspace (measured
at start-up, not known here), so the tokens shown are an upper bound. On CPU the KV cache is
`cpu_kvcache_space_gib` of host memory and the weights live outside it.

KV bytes per token on a rank: MLA caches one latent per token and layer, replicated on every
tensor-parallel rank; GQA splits its KV heads over tensor-parallel ranks. The engine's
`kv_cache_dtype` sets the bytes of a cached value (the model's dtype for "auto"); DeepSeek's
packed MLA layouts have a fixed size per token and layer.

Experts per rank: vLLM splits the physical expert slots of a MoE layer, the routed experts plus
EPLB's redundant copies, over the ranks of a group (DeepSeek-V3, EP32, 32 redundant: 288 / 32 =
9 per rank, not 8), and EPLB needs them to divide evenly.
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

# The engine's kv_cache_dtype -> bytes of one cached value (vllm/config/cache.py CacheDType; the
# fp8 caches keep their scales per layer, not per token).
KV_CACHE_VALUE_BYTES = {"bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1}
# DeepSeek's packed MLA caches, bytes per token and layer (vLLM's MLAAttention.get_kv_cache_spec):
# fp8_ds_mla is 512 fp8 latent values, 4 float32 scales and 64 bf16 RoPE values, 656 B against
# the bf16 cache's 576 x 2 = 1,152 B.
MLA_PACKED_BYTES_PER_LAYER = {"fp8_ds_mla": 656, "nvfp4_ds_mla": 352}


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


def kv_bytes_per_token_cached_as(kv_cache_dtype: str, *, model_bytes: int, value_bytes: int, num_layers: int,
                                  mla: bool) -> int | None:
    """KV bytes per token (all layers, one rank without TP) when the engine caches at
    `kv_cache_dtype`, from `model_bytes` at the model's dtype, whose values take `value_bytes`.
    None: a dtype this table does not size. A dense-MLA model (DeepSeek-V3) with "fp8" caches its
    576-value latent at one byte a value, 576 B per layer: vLLM 0.32 turns fp8 into the packed
    fp8_ds_mla only on its sparse-MLA backends (DeepSeek-V3.2), or when it is named."""
    if kv_cache_dtype == "auto":
        return model_bytes
    if mla and kv_cache_dtype in MLA_PACKED_BYTES_PER_LAYER:
        return num_layers * MLA_PACKED_BYTES_PER_LAYER[kv_cache_dtype]
    width = KV_CACHE_VALUE_BYTES.get(kv_cache_dtype)
    if width is None or value_bytes <= 0:
        return None
    return model_bytes * width // value_bytes


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
    """The smallest expert-parallel size (dividing the experts) at which a rank's weights fit.
    `num_experts` and `expert_bytes` count physical slots: EPLB's redundant copies included."""
    if not num_experts:
        return None
    for size in range(max(ep_size, 1) + 1, num_experts + 1):
        if num_experts % size == 0 and weights_per_rank(weight_bytes, expert_bytes, size, tp_size) < usable_bytes:
            return size
    return None
