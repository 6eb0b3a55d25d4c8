"""Reads what `plan` needs from a checkpoint directory (config.json, weight file sizes)."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.plan import ModelFacts

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def read_model_facts(path: Path, dtype: str) -> ModelFacts | None:
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    layers = int(config.get("num_hidden_layers", 0))
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or config.get("hidden_size", 0) // max(heads, 1))
    stored = str(config.get("torch_dtype", "bfloat16"))
    dtype = stored if dtype == "auto" else dtype
    element = _DTYPE_BYTES.get(str(dtype), 2)
    files = sorted(path.glob("*.safetensors"))
    # Weights are loaded at the manifest's dtype (a bf16 checkpoint served in float32 doubles).
    scale = element / _DTYPE_BYTES.get(stored, element)
    weights = int(sum(f.stat().st_size for f in files) * scale)
    expert_weights = int(sum(_routed_expert_bytes(f) for f in files) * scale)
    experts = config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts")
    return ModelFacts(
        weight_bytes=weights,
        num_layers=layers,
        kv_bytes_per_token=2 * layers * kv_heads * head_dim * element,
        num_experts=int(experts) if experts else None,
        expert_weight_bytes=expert_weights,
    )


def _routed_expert_bytes(file: Path) -> int:
    """Bytes of routed-expert tensors in one safetensors file, from its JSON header alone.

    Routed experts are named `...experts.<i>...` (Qwen3-MoE `mlp.experts`, Mixtral
    `block_sparse_moe.experts`, DeepSeek `mlp.experts`); `shared_experts` are dense.
    """
    with file.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < (100 << 20):
            return 0
        header = json.loads(f.read(size))
    total = 0
    for name, info in header.items():
        if name == "__metadata__" or ".experts." not in f".{name}":
            continue
        start, end = info["data_offsets"]
        total += end - start
    return total
