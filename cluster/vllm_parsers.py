"""The tool-call and reasoning parser names of the pinned vLLM (0.32), so that a manifest naming
one that does not exist fails at load with the list, not minutes later when the ingress starts.

Kept here rather than read from vLLM because importing vLLM's parser registries costs seconds
that `moe-serve plan`, `build` and `deploy` do not otherwise pay. tests/unit/cluster/test_vllm_parsers.py
compares these lists with the installed vLLM's registries: upgrading vLLM updates them.
"""

from __future__ import annotations

VLLM_VERSION = "0.32"

TOOL_PARSERS = frozenset({
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4",
    "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45", "glm47", "granite",
    "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "internlm", "jamba",
    "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json", "llama4_json", "llama4_pythonic", "longcat",
    "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral", "muse_glimmer", "olmo3", "openai", "phi4_mini_json",
    "plamo3", "poolside_v1", "pythonic", "qwen3_coder", "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5",
    "xlam",
})

REASONING_PARSERS = frozenset({
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41", "ernie45",
    "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo", "minicpmv", "minimax_m2",
    "minimax_m2_append_think", "minimax_m3", "mistral", "muse_glimmer", "nemotron_v3", "olmo3", "openai_gptoss",
    "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3", "step3p5",
})


def unknown_parser(kind: str, name: str) -> str | None:
    """None when vLLM knows `name` as a `kind` ("tool" or "reasoning") parser, else the problem."""
    known = TOOL_PARSERS if kind == "tool" else REASONING_PARSERS
    if name in known:
        return None
    return f"vLLM {VLLM_VERSION} has no {kind} parser named {name!r}; known: {', '.join(sorted(known))}"
