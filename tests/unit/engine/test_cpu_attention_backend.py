"""On CPU, float32 MLA models ask vLLM for its reference MLA backend: vLLM 0.32 otherwise picks
its AMX MLA backend on AMX machines, which cannot pack float32 weights (the model fails to load
there and loads elsewhere). Every other model and dtype keeps vLLM's own choice."""

from __future__ import annotations

from deployments.engine.vllm_engine import _hf_config, cpu_attention_backend

DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512, "qk_rope_head_dim": 64}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "num_key_value_heads": 4}


def test_float32_mla_asks_for_the_reference_cpu_mla_backend():
    assert cpu_attention_backend(DEEPSEEK_V3, "float32") == "CPU_MLA"


def test_other_dtypes_and_models_keep_vllms_choice():
    assert cpu_attention_backend(DEEPSEEK_V3, "bfloat16") is None
    assert cpu_attention_backend(QWEN3_MOE, "float32") is None
    assert cpu_attention_backend({}, "float32") is None


def test_an_unreadable_config_means_no_override(tmp_path):
    assert _hf_config(str(tmp_path)) == {}
    (tmp_path / "config.json").write_text("{not json")
    assert _hf_config(str(tmp_path)) == {}
