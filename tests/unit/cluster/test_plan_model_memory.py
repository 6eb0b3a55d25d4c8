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


# --- the engine's kv_cache_dtype and EPLB's redundant experts (GPU review M5) -------------------

def _ep16_with_kv(dtype):
    return _gpu_manifest([{**EP_DECODE, "engine": {"gpu_memory_utilization": 0.9,
                                                   "extra_args": {"kv_cache_dtype": dtype}}}])


@pytest.mark.parametrize("dtype, per_layer", [
    ("auto", 576 * 2), ("bfloat16", 576 * 2),
    # Dense MLA (DeepSeek-V3) with fp8: the 576-value latent at one byte each (vLLM's MLAAttention
    # spec: head_size 576 x the fp8 dtype's 1 byte); fp8_ds_mla only where it is named.
    ("fp8", 576), ("fp8_e4m3", 576),
    # DeepSeek's packed layout: 512 fp8 latent + 4 float32 scales + 64 bf16 RoPE = 656 B per layer.
    ("fp8_ds_mla", 656),
])
def test_deepseek_v3_kv_per_token_follows_the_engines_kv_cache_dtype(dtype, per_layer):
    manifest = _ep16_with_kv(dtype)
    plan = make_plan(manifest, _facts(manifest))
    memory = plan.pools[0].rank_memory
    assert memory.kv_bytes_per_token == 61 * per_layer  # 70,272 / 35,136 / 40,016 B per token
    assert memory.kv_tokens == memory.kv_cache_bytes // (61 * per_layer)
    assert plan.warnings == []
    assert (f"{dtype} KV: {61 * per_layer:,} B/token" in render_plan(plan)) == (dtype != "auto")


def test_an_fp8_kv_cache_holds_twice_the_tokens_of_bf16_and_the_packed_layout_1_76x():
    tokens = {dtype: make_plan(_ep16_with_kv(dtype), _facts(_ep16_with_kv(dtype))).pools[0].kv_cache_tokens_per_replica
              for dtype in ("auto", "fp8", "fp8_ds_mla")}
    assert tokens["fp8"] in (2 * tokens["auto"], 2 * tokens["auto"] + 1)
    # 70,272 / 40,016: counted at bf16, a packed fp8 cache's capacity is understated by 43%
    assert round(tokens["fp8_ds_mla"] / tokens["auto"], 2) == 1.76


def test_gqa_fp8_kv_halves_every_tp_ranks_share():
    facts = read_model_facts(Path("/absent/GLM-4.5"), "auto", model_name="zai-org/GLM-4.5")
    assert facts.kv_bytes_per_token_on_rank(1) == 376_832
    assert facts.kv_bytes_per_token_on_rank(1, "fp8") == 376_832 // 2
    assert facts.kv_bytes_per_token_on_rank(4, "fp8_e5m2") == 376_832 // 2 // 4
    assert facts.kv_bytes_per_token_cached_as("fp8_ds_mla") is None  # an MLA layout: GQA has none


def test_a_kv_cache_dtype_plan_cannot_size_warns_and_counts_the_model_dtype():
    manifest = _ep16_with_kv("turboquant_k8v4")
    plan = make_plan(manifest, _facts(manifest))
    assert plan.pools[0].rank_memory.kv_bytes_per_token == 70_272
    (warning,) = plan.warnings
    assert "kv_cache_dtype 'turboquant_k8v4'" in warning and "fp8_ds_mla" in warning


def test_the_kv_pool_counts_tokens_at_the_engines_kv_cache_dtype():
    from cluster.plan import kv_pool_capacity_tokens

    pool = {**EP_DECODE, "engine": {"extra_args": {"kv_cache_dtype": "fp8"}}}
    manifest = _gpu_manifest([pool])
    manifest = manifest.model_copy(update={"kv_pool": manifest.kv_pool.model_copy(update={"enabled": True})})
    # 16 ranks x 256 MiB, at 35,136 B per token rather than 70,272
    assert kv_pool_capacity_tokens(manifest, _facts(manifest)) == 16 * 256 * 2**20 // 35_136


DISAGG = Path(__file__).resolve().parents[3] / "manifests" / "deepseek-v3-h200-disagg-ep.yaml"


def test_decode_ranks_hold_their_share_of_eplbs_redundant_experts():
    """EP32 with 32 redundant experts: vLLM splits 256 + 32 = 288 expert slots, 9 per rank."""
    from cluster.manifest import load_manifest

    manifest = load_manifest(DISAGG)
    facts = _facts(manifest)
    plan = make_plan(manifest, facts)
    decode = next(pool for pool in plan.pools if pool.name == "decode")
    ranges = [rank.experts for rank in decode.replicas]
    assert ranges[0] == (0, 8) and ranges[31] == (279, 287)
    assert {last - first + 1 for first, last in ranges} == {9}
    dense = facts.weight_bytes - facts.expert_weight_bytes
    assert decode.rank_memory.weight_bytes == dense + -(-facts.expert_weight_bytes * 288 // 256 // 32)
    per_expert = facts.expert_weight_bytes / 256  # all 58 MoE layers' copies of one expert, ~2.38 GiB
    assert abs(decode.rank_memory.weight_bytes - (dense + 8 * per_expert) - per_expert) < 1 << 20
    text = render_plan(plan)
    assert "9 each" in text and "EPLB on, 32 redundant experts (288 slots, 9 per rank)" in text
    assert plan.errors == []


def test_eplb_slots_that_do_not_split_evenly_fail_the_plan():
    manifest = _gpu_manifest([{**EP_DECODE, "expert_parallel": {
        "size": 32, "placement_strategy": "PACK", "enable_eplb": True, "num_redundant_experts": 16}}])
    (error,) = make_plan(manifest, _facts(manifest)).errors
    assert "272 expert slots (256 routed + 16 redundant)" in error and "32 ranks" in error
    assert "num_redundant_experts" in error


def test_the_smallest_fitting_split_counts_redundant_experts():
    # At 0.7 of an H200 (98.28 GiB): EP8 holds 32 of 256 experts (93.9 GiB) but 36 of 288 slots
    # (103.4 GiB); EP9 holds 32 of 288 slots.
    def error(ep):
        manifest = _gpu_manifest([{**EP_DECODE, "engine": {"gpu_memory_utilization": 0.7},
                                   "expert_parallel": {"size": 4, "placement_strategy": "PACK", **ep}}])
        (text,) = make_plan(manifest, _facts(manifest)).errors
        return text

    assert "expert_parallel.size: 8 (the smallest that divides 256 experts and fits)" in error({})
    assert "expert_parallel.size: 9 (the smallest that divides 288 expert slots" in error(
        {"enable_eplb": True, "num_redundant_experts": 32})
