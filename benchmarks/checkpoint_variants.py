"""Checkpoints the benchmarks build beside the builtin tiny ones, for questions the tiny ones
cannot answer. Built locally with random weights and a fixed seed (cluster/checkpoints.py),
like the builtin ones; nothing is downloaded."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path


def wide_qwen3_moe() -> Path:
    """The tiny Qwen3-MoE at 3x the width and 1.5x the depth (hidden 384, 6 layers, 6 query heads
    of 64): its prefill costs ~10x as much per token, so a prompt of a thousand tokens takes a
    few hundred milliseconds on this CPU. That is the share of TTFT prefill has for a real MoE
    model on GPUs; the tiny model's ~40 ms is lost in the request path's fixed cost, which hides
    whatever saves prefill work (cache-aware routing, the KV pool)."""
    from cluster.checkpoints import SPECS, ensure_spec

    base = SPECS["tiny-qwen3-moe"]
    return ensure_spec(replace(base, name="bench-qwen3-moe-wide", config={
        **base.config, "hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6,
        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 768, "moe_intermediate_size": 192}))
