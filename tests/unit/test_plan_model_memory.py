"""The plan's memory arithmetic against figures computed by hand from the public configs of
DeepSeek-V3 (MLA, 61 layers, 256 routed experts, FP8) and GLM-4.5 (GQA, 92 layers, 160
experts), and the fit check that refuses a manifest whose weights cannot fit its ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.manifest import parse_manifest
from cluster.model_arch import read_architecture
from cluster.model_facts import SHIPPED_CONFIGS, read_model_facts
from cluster.plan import make_plan, render_plan
from cluster.plan_memory import ACCELERATOR_MEMORY_GIB, GIB

DEEPSEEK = json.loads((SHIPPED_CONFIGS / "deepseek-ai--DeepSeek-V3.json").read_text())
GLM = json.loads((SHIPPED_CONFIGS / "zai-org--GLM-4.5.json").read_text())
QWEN = json.loads((SHIPPED_CONFIGS / "Qwen--Qwen3-235B-A22B.json").read_text())

# DeepSeek-V3 by hand. Attention (MLA) per layer: q_a 7168x1536 + q_b 1536x128x(128+64)
# + kv_a 7168x(512+64) + kv_b 512x128x(128+128) + o 128x128x7168.
DS_ATTN = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
DS_EXPERT = 3 * 7168 * 2048  # gate, up, down of one routed (or the shared) expert
DS_ROUTED = 58 * 256 * DS_EXPERT  # layers 3..60 are MoE (first_k_dense_replace = 3)
DS_DENSE = (61 * DS_ATTN + 3 * 3 * 7168 * 18432 + 58 * DS_EXPERT  # attention, 3 dense MLPs, shared experts
            + 58 * 256 * (7168 + 1)  # routers and their correction bias
            + 2 * 129280 * 7168  # embeddings and LM head
            + 61 * (2 * 7168 + 512 + 1536) + 7168)  # norms


def test_deepseek_v3_parameters_match_the_hand_count_and_the_published_671b():
    arch = read_architecture(DEEPSEEK)
    assert arch.params.routed_experts == DS_ROUTED
    assert arch.params.dense == DS_DENSE
    assert abs(arch.params.total / 671e9 - 1) < 0.002
    assert (arch.moe_layers, arch.num_experts, arch.shared_experts, arch.mla) == (58, 256, 1, True)


def test_deepseek_v3_kv_is_one_576_value_latent_per_token_and_layer_on_every_tp_rank():
    arch = read_architecture(DEEPSEEK)
    assert arch.kv_bytes_per_token(2) == 61 * 576 * 2 == 70_272
    assert arch.kv_bytes_per_token(2, tensor_parallel=8) == 70_272  # replicated, not split


def test_deepseek_v3_fp8_weights_are_one_byte_per_linear_weight_plus_block_scales():
    arch = read_architecture(DEEPSEEK)
    assert arch.quantization == "fp8"
    weights, experts = arch.weight_bytes(2)
    linear_dense = arch.params.linear_dense
    expected_experts = DS_ROUTED + -(-DS_ROUTED // (128 * 128)) * 4
    expected = (expected_experts + linear_dense + -(-linear_dense // (128 * 128)) * 4
                + (DS_DENSE - linear_dense) * 2)
    assert experts == expected_experts and weights == expected
    assert 620 * GIB < weights < 635 * GIB  # the FP8 release is ~642 GB without its MTP layer


def test_glm45_parameters_and_gqa_kv_by_hand():
    arch = read_architecture(GLM)
    attn = 5120 * (96 + 2 * 8) * 128 + 96 * 128 * 5120  # q, k, v, o
    assert arch.params.routed_experts == 89 * 160 * 3 * 5120 * 1536  # layers 3..91
    assert (arch.moe_layers, arch.mla, arch.kv_heads, arch.head_dim) == (89, False, 8, 128)
    assert arch.params.linear_dense == 92 * attn + 3 * 3 * 5120 * 12288 + 89 * 3 * 5120 * 1536
    # K and V x 92 layers x 8 KV heads x 128 x bf16
    assert arch.kv_bytes_per_token(2) == 2 * 92 * 8 * 128 * 2 == 376_832
    assert arch.kv_bytes_per_token(2, tensor_parallel=4) == 376_832 // 4
    assert arch.kv_bytes_per_token(2, tensor_parallel=16) == 376_832 // 8  # one KV head per rank at least
    assert abs(arch.params.total / 353e9 - 1) < 0.01  # 355B published, with the MTP layer


def test_qwen3_235b_is_235b():
    assert abs(read_architecture(QWEN).params.total / 235e9 - 1) < 0.005


def _gpu_manifest(pools, **model):
    return parse_manifest({
        "name": "t", "accelerator": "gpu",
        "model": {"name": "deepseek-ai/DeepSeek-V3", "path": "/absent/DeepSeek-V3", "dtype": "auto", **model},
        "pools": pools}, "test")


def _facts(manifest):
    model = manifest.model
    return read_model_facts(Path(model.path), model.dtype, model_name=model.name, quantization=model.quantization)


EP_DECODE = {"name": "decode", "role": "colocated", "replicas": 1,
             "placement": {"node_labels": {"accelerator-type": "H200"}, "num_gpus": 1},
             "engine": {"gpu_memory_utilization": 0.9}, "expert_parallel": {"size": 16, "placement_strategy": "PACK"}}


def test_ep16_rank_of_deepseek_v3_on_h200_by_hand():
    manifest = _gpu_manifest([EP_DECODE])
    facts = _facts(manifest)
    plan = make_plan(manifest, facts)
    memory = plan.pools[0].rank_memory
    dense = facts.weight_bytes - facts.expert_weight_bytes
    assert memory.weight_bytes == dense + -(-facts.expert_weight_bytes // 16)
    device = int(ACCELERATOR_MEMORY_GIB["H200"] * GIB)
    assert memory.usable_bytes == int(device * 0.9)
    assert memory.kv_tokens == (int(device * 0.9) - memory.weight_bytes) // 70_272
    assert plan.errors == []
    text = render_plan(plan)
    assert "x16" in text and text.count("\ndecode ") == 1  # 16 identical ranks, one row
    assert "MLA (576-value latent), 70,272 KV bytes/token" in text


def test_weights_that_do_not_fit_fail_with_the_numbers_and_the_smallest_fitting_split():
    manifest = _gpu_manifest([{**EP_DECODE, "expert_parallel": {"size": 4, "placement_strategy": "PACK"}}])
    plan = make_plan(manifest, _facts(manifest))
    (error,) = plan.errors
    assert "each rank loads" in error and "140.40 GiB x gpu_memory_utilization 0.9" in error
    assert "expert_parallel.size: 8" in error  # 4 ranks: ~159 GiB each; 8 ranks: ~82 GiB


def test_cli_plan_exits_2_and_deploy_refuses_before_starting_anything(tmp_path, capsys):
    import yaml

    data = {"name": "t", "accelerator": "gpu",
            "model": {"name": "deepseek-ai/DeepSeek-V3", "path": str(tmp_path / "absent"), "dtype": "auto"},
            "pools": [{**EP_DECODE, "expert_parallel": {"size": 2, "placement_strategy": "PACK"}}]}
    path = tmp_path / "too-small.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", str(path)]) == 2
    assert "error: pool decode: each rank loads" in capsys.readouterr().out
    # deploy checks the fit before it connects to any cluster (none runs here)
    assert main(["deploy", str(path), "--address", "127.0.0.1:1"]) == 2
    assert "each rank loads" in capsys.readouterr().err


def test_unknown_accelerator_warns_and_memory_can_be_given():
    pool = {**EP_DECODE, "placement": {"num_gpus": 1}}
    plan = make_plan(_gpu_manifest([pool]), _facts(_gpu_manifest([pool])))
    assert any("accelerator memory unknown" in w for w in plan.warnings)
    pool = {**EP_DECODE, "placement": {"num_gpus": 1, "accelerator_memory_gib": 80}}
    plan = make_plan(_gpu_manifest([pool]), _facts(_gpu_manifest([pool])))
    assert plan.pools[0].rank_memory.usable_bytes == int(80 * GIB * 0.9)


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-glm4-moe"])
def test_tiny_checkpoints_kv_bytes_match_what_vllm_allocates(name):
    """vLLM CPU logged 116,496 tokens for 1 GiB with tiny-deepseek-v3 (4 layers x 576 x fp32,
    rounded to 16-token blocks) and 524,288 for tiny-glm4-moe (2 x 4 x 2 x 32 x fp32)."""
    from cluster.checkpoints import SPECS  # the spec's config only: nothing is built

    spec = SPECS[name]
    config = {**spec.config, "model_type": spec.model_type, "vocab_size": spec.vocab_size}
    arch = read_architecture(config)
    assert arch.kv_bytes_per_token(4) == (4 * 576 * 4 if name == "tiny-deepseek-v3" else 2 * 4 * 2 * 32 * 4)
