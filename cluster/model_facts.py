"""Reads what `plan` needs of a model: its architecture from `config.json` (the checkpoint's, or
a shipped copy of a public model's when the weights are not on this machine) and, when the
checkpoint is here, the bytes of its weight files."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.model_arch import DTYPE_BYTES, ArchitectureError, read_architecture
from cluster.plan import ModelFacts

SHIPPED_CONFIGS = Path(__file__).resolve().parent / "model_configs"


def shipped_config(model_name: str) -> Path | None:
    """The shipped config.json of a public model (`deepseek-ai/DeepSeek-V3`), if we have one."""
    candidate = SHIPPED_CONFIGS / (model_name.replace("/", "--") + ".json")
    return candidate if candidate.is_file() else None


def read_model_facts(path: Path, dtype: str, *, model_name: str | None = None,
                     quantization: str | None = None) -> ModelFacts | None:
    config_file = path / "config.json"
    source = "checkpoint"
    if not config_file.is_file():
        config_file = shipped_config(model_name) if model_name else None
        source = f"shipped config of {model_name}"
        if config_file is None:
            return None
    config = json.loads(config_file.read_text())
    try:
        arch = read_architecture(config)
    except ArchitectureError:
        return None
    text = config.get("text_config", config)
    stored = str(text.get("torch_dtype") or text.get("dtype") or "bfloat16")
    dtype = stored if dtype == "auto" else dtype
    element = DTYPE_BYTES.get(str(dtype), 2)
    files = sorted(path.glob("*.safetensors")) if source == "checkpoint" else []
    if files and not quantization:
        # Weights are loaded at the manifest's dtype (a bf16 checkpoint served in float32 doubles).
        scale = element / DTYPE_BYTES.get(stored, element) if arch.quantization is None else 1.0
        weights = int(sum(f.stat().st_size for f in files) * scale)
        expert_weights = int(sum(_routed_expert_bytes(f) for f in files) * scale)
    else:
        weights, expert_weights = arch.weight_bytes(element, quantization)
        source += " (weights counted from the architecture)"
    return ModelFacts(
        weight_bytes=weights,
        num_layers=arch.num_layers,
        kv_bytes_per_token=arch.kv_bytes_per_token(element),
        num_experts=arch.num_experts,
        expert_weight_bytes=expert_weights,
        attention=arch.attention,
        mla=arch.mla,
        kv_heads=arch.kv_heads,
        kv_element_bytes=element,
        source=source,
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
