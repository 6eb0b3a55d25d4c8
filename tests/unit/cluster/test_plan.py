"""Placement math of `moe-serve plan` (pure) and the `plan` command end to end (no Ray)."""

import json
from pathlib import Path

import pytest
import yaml

from cluster.cli import main
from cluster.manifest import load_manifest, parse_manifest
from cluster.model_facts import read_model_facts
from cluster.fit_check import model_facts_for
from cluster.plan import INGRESS_NUM_CPUS, ModelFacts, make_plan, render_plan

MANIFESTS = sorted((Path(__file__).resolve().parents[3] / "manifests").glob("*.yaml"))
MANIFESTS_DIR = Path(__file__).resolve().parents[3] / "manifests"
LOCAL = next(p for p in MANIFESTS if p.name == "local.yaml")  # disaggregated: prefill + decode
COLOCATED = next(p for p in MANIFESTS if p.name == "local-colocated.yaml")
GPU = next(p for p in MANIFESTS if p.name == "deepseek-v3-h200.yaml")


def cpu_manifest(*, nodes: list[dict], pools: list[dict], **extra):
    return parse_manifest({
        "name": "t",
        "model": {"name": "m", "path": "builtin://tiny-qwen3-moe"},
        "local_cluster": {"nodes": nodes},
        "pools": pools,
        **extra,
    })


THREE_NODES = [
    {"name": "head", "num_cpus": 4, "labels": {"role": "head"}},
    {"name": "e0", "num_cpus": 4, "labels": {"role": "engine"}},
    {"name": "e1", "num_cpus": 4, "labels": {"role": "engine", "zone": "b"}},
]


def test_replicas_spread_round_robin_over_matching_nodes():
    manifest = cpu_manifest(nodes=THREE_NODES, pools=[
        {"name": "engine", "replicas": 5, "placement": {"node_labels": {"role": "engine"}, "num_cpus": 0.5}}])
    plan = make_plan(manifest)
    (pool,) = plan.pools
    assert [(r.replica_index, r.node) for r in pool.replicas] == [(0, "e0"), (1, "e1"), (2, "e0"), (3, "e1"), (4, "e0")]
    assert plan.node_cpu_reserved == {"head": INGRESS_NUM_CPUS, "e0": 1.5, "e1": 1.0}
    assert plan.ingress_node == "head"
    assert plan.warnings == []


def test_selector_with_several_labels_narrows_the_nodes():
    manifest = cpu_manifest(nodes=THREE_NODES, pools=[
        {"name": "engine", "replicas": 2, "placement": {"node_labels": {"role": "engine", "zone": "b"}}}])
    assert [r.node for r in make_plan(manifest).pools[0].replicas] == ["e1", "e1"]


def test_pool_without_labels_may_use_every_node():
    manifest = cpu_manifest(nodes=THREE_NODES, pools=[{"name": "engine", "replicas": 4}])
    assert [r.node for r in make_plan(manifest).pools[0].replicas] == ["head", "e0", "e1", "head"]


def test_cpu_oversubscription_warns_about_the_node():
    manifest = cpu_manifest(
        nodes=[{"name": "head", "num_cpus": 1}, {"name": "small", "num_cpus": 2, "labels": {"role": "engine"}}],
        pools=[{"name": "engine", "replicas": 3, "placement": {"node_labels": {"role": "engine"}, "num_cpus": 1}}])
    plan = make_plan(manifest)
    assert plan.node_cpu_reserved["small"] == 3
    (warning,) = plan.warnings
    assert "small" in warning and "3" in warning and "advertises 2" in warning
    assert f"warning: {warning}" in render_plan(plan)


def test_ingress_cpus_count_against_the_head():
    # The head advertises 1 CPU; one engine replica (1 CPU) plus the ingress (0.25) overfill it.
    manifest = cpu_manifest(nodes=[{"name": "head", "num_cpus": 1}], pools=[{"name": "engine"}])
    plan = make_plan(manifest)
    assert plan.node_cpu_reserved == {"head": 1 + INGRESS_NUM_CPUS}
    assert len(plan.warnings) == 1 and "head" in plan.warnings[0]


def test_local_manifest_plan_fits():
    plan = make_plan(load_manifest(LOCAL))
    assert plan.warnings == []
    assert [(p.name, p.role, [r.node for r in p.replicas]) for p in plan.pools] == [
        ("prefill", "prefill", ["prefill-0"]), ("decode", "decode", ["decode-0", "decode-1"])]
    assert [r.rank for r in plan.pools[1].replicas] == [0, 1]
    assert plan.node_cpu_reserved == {"head": INGRESS_NUM_CPUS, "prefill-0": 1, "decode-0": 1, "decode-1": 1}
    assert plan.endpoint_url == "http://127.0.0.1:8000"
    assert plan.kv_transfer == ("decode pulls prompt KV from prefill over tcp; lease 30s, "
                                "timeout 5s, both + the KV's bytes at 64 MiB/s, on failure: recompute")


def test_colocated_local_manifest_plan_fits_without_a_kv_transfer_line():
    plan = make_plan(load_manifest(COLOCATED))
    assert plan.warnings == []
    assert [r.node for r in plan.pools[0].replicas] == ["engine-0"]
    assert plan.kv_transfer is None
    assert "kv transfer" not in render_plan(plan)


def test_gpu_manifest_without_local_cluster_shows_the_selector():
    plan = make_plan(load_manifest(GPU))
    (pool,) = plan.pools
    assert len(pool.replicas) == 4
    assert {r.node for r in pool.replicas} == {"nodes with accelerator-type=H200"}
    assert {(r.num_cpus, r.num_gpus) for r in pool.replicas} == {(16, 8)}
    assert plan.node_cpu_reserved == {}
    assert plan.ingress_node.startswith("any node")
    # vLLM sizes GPU KV caches at start-up, so the plan does not guess.
    assert pool.kv_cache_bytes_per_replica is None and pool.kv_cache_tokens_per_replica is None
    text = render_plan(plan)
    assert "nodes with accelerator-type=H200" in text
    assert "auto (GPU memory)" in text


def test_kv_tokens_from_model_facts():
    manifest = cpu_manifest(nodes=THREE_NODES, pools=[
        {"name": "engine", "placement": {"node_labels": {"role": "engine"}}, "engine": {"cpu_kvcache_space_gib": 2}}])
    facts = ModelFacts(weight_bytes=3 << 30, num_layers=4, kv_bytes_per_token=1000, num_experts=8)
    plan = make_plan(manifest, facts)
    (pool,) = plan.pools
    assert pool.kv_cache_bytes_per_replica == 2 << 30
    assert pool.kv_cache_tokens_per_replica == (2 << 30) // 1000
    text = render_plan(plan)
    assert f"{(2 << 30) // 1000:,} tokens" in text
    assert "3.00 GiB weights, 4 layers, 8 routed experts/layer, 1,000 KV bytes/token" in text


def test_kv_bytes_without_facts_leave_tokens_unknown():
    plan = make_plan(load_manifest(LOCAL))
    pool = plan.pools[0]
    assert pool.kv_cache_bytes_per_replica == 1 << 30
    assert pool.kv_cache_tokens_per_replica is None
    assert "sizes unknown" in render_plan(plan)


def test_render_plan_lists_every_pool_replica_and_node():
    manifest = cpu_manifest(nodes=THREE_NODES, pools=[
        {"name": "alpha", "role": "prefill", "replicas": 2, "placement": {"node_labels": {"role": "engine"}}},
        {"name": "beta", "role": "decode", "replicas": 1, "placement": {"node_labels": {"role": "head"}}},
    ])
    text = render_plan(make_plan(manifest))
    rows = [line.split() for line in text.splitlines() if line.startswith(("alpha", "beta"))]
    assert [(r[0], r[1], r[2], r[5]) for r in rows] == [
        ("alpha", "prefill", "0", "e0"), ("alpha", "prefill", "1", "e1"), ("beta", "decode", "0", "head")]
    assert "application t: model m" in text
    assert "ingress      on head" in text
    assert "cpus reserved per node: head=1.25, e0=1, e1=1" in text


FOUR_NODES = [
    {"name": "head", "num_cpus": 2, "labels": {"moe-role": "head"}},
    {"name": "p0", "num_cpus": 4, "labels": {"moe-role": "prefill"}},
    {"name": "p1", "num_cpus": 4, "labels": {"moe-role": "prefill"}},
    {"name": "d0", "num_cpus": 4, "labels": {"moe-role": "decode"}},
]


def test_disaggregated_plan_renders_kv_transfer_and_places_each_role_on_its_nodes():
    manifest = cpu_manifest(
        nodes=FOUR_NODES,
        pools=[
            {"name": "pre", "role": "prefill", "replicas": 3, "placement": {"node_labels": {"moe-role": "prefill"}}},
            {"name": "dec", "role": "decode", "replicas": 2, "placement": {"node_labels": {"moe-role": "decode"}}},
        ],
        kv_transfer={"lease_s": 2.5, "transfer_timeout_s": 0.75, "failure_policy": "fail"},
    )
    plan = make_plan(manifest)
    expected_line = ("decode pulls prompt KV from prefill over tcp; lease 2.5s, timeout 0.75s, both + the KV's bytes "
                     "at 64 MiB/s, on failure: fail")
    assert plan.kv_transfer == expected_line
    text = render_plan(plan)
    lines = text.splitlines()
    # The transfer path is stated in the header, after the ingress and before the replica table.
    assert lines.index(f"kv transfer  {expected_line}") == lines.index("ingress      on head") + 1
    rows = [[c for i, c in enumerate(line.split()) if i in (0, 1, 2, 5)] for line in lines if line.startswith(("pre ", "dec "))]
    assert rows == [["pre", "prefill", "0", "p0"], ["pre", "prefill", "1", "p1"], ["pre", "prefill", "2", "p0"],
                    ["dec", "decode", "0", "d0"], ["dec", "decode", "1", "d0"]]
    assert plan.node_cpu_reserved == {"head": INGRESS_NUM_CPUS, "p0": 2, "p1": 1, "d0": 2}
    assert plan.warnings == []


def test_read_model_facts(tmp_path):
    config = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
              "num_experts": 8, "hidden_size": 128, "vocab_size": 1000, "intermediate_size": 256,
              "model_type": "qwen3_moe"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1234)
    facts = read_model_facts(tmp_path, "bfloat16")
    # K and V (2) x layers (4) x kv heads (2) x head dim (32) x bf16 (2 bytes); the weight
    # bytes are the files' (the header cannot be parsed, so no expert share is found)
    assert (facts.weight_bytes, facts.num_layers, facts.kv_bytes_per_token, facts.num_experts) == (1234, 4, 1024, 8)
    assert facts.attention == "GQA (2 KV heads x 32)" and facts.source == "checkpoint"
    assert read_model_facts(tmp_path, "float32").kv_bytes_per_token == 2048
    assert read_model_facts(tmp_path / "absent", "bfloat16") is None


# -- the CLI ----------------------------------------------------------------------------------


@pytest.fixture
def no_checkpoints(tmp_path, monkeypatch):
    """Point builtin checkpoints at an empty folder so output does not depend on ~/.cache."""
    root = tmp_path / "checkpoints"
    monkeypatch.setenv("MOE_SERVE_CHECKPOINTS", str(root))
    return root


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_cli_plan_every_manifest(path, no_checkpoints, capsys):
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    manifest = load_manifest(path)
    assert f"application {manifest.name}: model {manifest.model.name}" in out
    for pool in manifest.pools:
        # Identical ranks share one row; its "xN" count says how many.
        counts = [int(next(c for c in line.split() if c.startswith("x") and c[1:].isdigit())[1:])
                  for line in out.splitlines() if line.startswith(pool.name + " ")]
        assert sum(counts) == pool.replicas * pool.ranks_per_replica
    assert not no_checkpoints.exists()  # plan never builds a checkpoint


def test_cli_plan_defaults_to_the_local_manifest(no_checkpoints, capsys):
    assert main(["plan"]) == 0
    out = capsys.readouterr().out
    assert "application moe-local: model tiny-qwen3-moe" in out
    assert "kv transfer  decode pulls prompt KV from prefill over tcp" in out  # the default is disaggregated


def test_cli_plan_reads_facts_of_a_built_checkpoint(no_checkpoints, capsys):
    ckpt = no_checkpoints / "tiny-qwen3-moe"
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
         "hidden_size": 128, "vocab_size": 1000, "intermediate_size": 256}))
    assert main(["plan", str(LOCAL)]) == 0
    # 1 GiB CPU KV cache / (2 x 4 layers x 2 heads x 32 dims x 4 bytes (float32) per token)
    assert "524,288 tokens" in capsys.readouterr().out


def test_cli_plan_broken_manifest_exits_2_with_the_issue(tmp_path, capsys):
    data = yaml.safe_load(LOCAL.read_text())
    data["pools"][0]["replica"] = 2
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"error: invalid manifest {path}")
    assert "pools[0].replica: unknown field (got 2)" in captured.err
    assert "replicas" in captured.err.split("Fix:")[1]


def test_cli_plan_missing_file_exits_2(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read" in capsys.readouterr().err


EP_POOL = {"name": "dec", "role": "colocated", "replicas": 2, "placement": {"node_labels": {"role": "engine"}},
           "expert_parallel": {"size": 2}}
TINY_FACTS = ModelFacts(weight_bytes=1000, num_layers=4, kv_bytes_per_token=1024, num_experts=8,
                        expert_weight_bytes=800)


def test_expert_parallel_plan_places_each_rank_of_a_group_on_its_own_node_with_its_experts():
    manifest = cpu_manifest(nodes=THREE_NODES, pools=[EP_POOL])
    plan = make_plan(manifest, TINY_FACTS)
    (pool,) = plan.pools
    rows = [(r.replica_index, r.rank, r.node, r.experts, r.weight_bytes) for r in pool.replicas]
    assert rows == [(0, 0, "e0", (0, 3), 600), (0, 1, "e1", (4, 7), 600),
                    (1, 0, "e1", (0, 3), 600), (1, 1, "e0", (4, 7), 600)]
    assert plan.node_cpu_reserved == {"head": INGRESS_NUM_CPUS, "e0": 2, "e1": 2}
    assert "EPLB unavailable" in pool.expert_parallel
    text = render_plan(plan)
    assert "experts      pool dec: 2 ranks per replica" in text
    assert [line.split()[3:6] for line in text.splitlines() if line.startswith("dec ")] == [
        ["0", "0-3", "e0"], ["1", "4-7", "e1"], ["0", "0-3", "e1"], ["1", "4-7", "e0"]]


def test_uneven_expert_split_gives_the_first_ranks_one_more_and_warns():
    manifest = cpu_manifest(nodes=THREE_NODES, pools=[{**EP_POOL, "replicas": 1,
                                                       "expert_parallel": {"size": 3, "placement_strategy": "PACK"}}])
    plan = make_plan(manifest, TINY_FACTS)
    assert [r.experts for r in plan.pools[0].replicas] == [(0, 2), (3, 5), (6, 7)]
    assert any("do not split evenly" in w for w in plan.warnings)


def test_builtin_checkpoint_facts_count_routed_expert_bytes(tmp_path):
    from cluster.checkpoints import resolve_model_path

    facts = read_model_facts(resolve_model_path("builtin://tiny-qwen3-moe"), "bfloat16")
    assert facts.num_experts == 8
    assert 0.5 * facts.weight_bytes < facts.expert_weight_bytes < facts.weight_bytes


@pytest.mark.parametrize("change, field, fix", [
    ({"expert_parallel": {"size": 2, "enable_eplb": True}}, "pools[0].expert_parallel.enable_eplb", "enable_eplb: false"),
    ({"expert_parallel": {"size": 2, "num_redundant_experts": 4}}, "pools[0].expert_parallel.num_redundant_experts",
     "enable_eplb"),
    ({"expert_parallel": {"size": 3}}, "pools[0].expert_parallel.size", "PACK"),
    ({"expert_parallel": {"size": 2}, "engine": {"tensor_parallel_size": 2}}, "pools[0].engine.tensor_parallel_size",
     "tensor_parallel_size: 1"),
    ({"expert_parallel": {"size": 1}}, "pools.0.expert_parallel.size", ""),
])
def test_bad_expert_parallel_settings_name_the_field_and_the_fix(change, field, fix):
    from cluster.manifest import ManifestError

    with pytest.raises(ManifestError) as caught:
        cpu_manifest(nodes=THREE_NODES, pools=[{**EP_POOL, **change}])
    issue = next(i for i in caught.value.issues if i.field.replace("[", ".").replace("]", "") ==
                 field.replace("[", ".").replace("]", ""))
    assert fix in issue.fix


def test_plan_shows_the_kv_pool_capacity_in_tokens_of_the_model():
    manifest = load_manifest(Path(__file__).resolve().parents[3] / "manifests" / "local.yaml")
    facts = ModelFacts(weight_bytes=1 << 20, num_layers=4, kv_bytes_per_token=2048)
    plan = make_plan(manifest, facts)
    # prefill (1 engine) + decode (one group of 2 ranks): 3 engines x 256 MiB, 2,048 B per token
    assert plan.kv_pool.startswith("mooncake store over tcp")
    assert f"3 engine(s) x 256 MiB = 0.75 GiB = {3 * 256 * 2**20 // 2048:,} tokens" in plan.kv_pool
    assert f"kv pool      {plan.kv_pool}" in render_plan(plan)
    off = parse_manifest({**yaml.safe_load((Path(__file__).resolve().parents[3] / "manifests" / "local.yaml")
                                          .read_text()), "kv_pool": {"enabled": False}})
    assert make_plan(off, facts).kv_pool is None


def test_the_prefix_routers_learn_the_kv_pool_capacity_in_their_blocks():
    from cluster.plan import kv_pool_capacity_tokens

    manifest = load_manifest(Path(__file__).resolve().parents[3] / "manifests" / "local.yaml")
    facts = ModelFacts(weight_bytes=1 << 20, num_layers=4, kv_bytes_per_token=2048)
    tokens = kv_pool_capacity_tokens(manifest, facts)
    assert tokens == 3 * 256 * 2**20 // 2048
    prefill = next(p for p in manifest.pools if p.name == "prefill")
    kwargs = prefill.routing.router_kwargs("prefill", 128, 4096, pool_capacity_blocks=tokens // 128)
    assert (kwargs["policy"], kwargs["pool_capacity_blocks"], kwargs["pool_hit_value"]) == ("prefix", tokens // 128, 0.8)
    # No pool, or a pool hit valued at 0: the router ignores the pool.
    assert "pool_capacity_blocks" not in prefill.routing.router_kwargs("prefill", 128, 4096)
    ignored = prefill.routing.model_copy(update={"pool_hit_value": 0.0})
    assert "pool_capacity_blocks" not in ignored.router_kwargs("prefill", 128, 4096, pool_capacity_blocks=99)
    off = parse_manifest({**yaml.safe_load((Path(__file__).resolve().parents[3] / "manifests" / "local.yaml")
                                          .read_text()), "kv_pool": {"enabled": False}})
    assert kv_pool_capacity_tokens(off, facts) == 0
    # Prefill contributing nothing: the decode group's two ranks hold the pool.
    data = yaml.safe_load((Path(__file__).resolve().parents[3] / "manifests" / "local.yaml").read_text())
    data["kv_pool"]["prefill_segment_mib"] = 0
    assert kv_pool_capacity_tokens(parse_manifest(data), facts) == 2 * 256 * 2**20 // 2048
    line = make_plan(parse_manifest(data), facts).kv_pool
    assert "1 prefill engine(s) x 0 MiB + 2 decode engine(s) x 256 MiB = 0.50 GiB" in line, line


def test_the_plan_shows_what_a_longest_prompt_adds_to_the_transfer_bounds():
    manifest = load_manifest(MANIFESTS_DIR / "deepseek-v3-h200-disagg-ep.yaml")
    plan = make_plan(manifest, model_facts_for(manifest))
    # 131,072 tokens x 70,272 B of bf16 latents per token and rank, at 1,024 MiB/s.
    assert "a 131,072-token prompt: 8,784 MiB per rank, +8.6s" in plan.kv_transfer
    assert plan.errors == []


def test_a_staging_arena_smaller_than_one_longest_prompt_is_an_error_naming_the_field_and_the_fix():
    data = yaml.safe_load((MANIFESTS_DIR / "deepseek-v3-h200-disagg-ep.yaml").read_text())
    data["kv_transfer"]["staging_mib"] = 1024
    manifest = parse_manifest(data, "gpu.yaml")
    (error,) = make_plan(manifest, model_facts_for(manifest)).errors
    assert error.startswith("kv_transfer.staging_mib=1024: a 131,072-token prompt's KV is 8,784 MiB per rank")
    assert "raise staging_mib to at least 8784, or lower model.max_model_len" in error
    data["model"]["max_model_len"] = 8192  # 549 MiB: fits
    manifest = parse_manifest(data, "gpu.yaml")
    assert make_plan(manifest, model_facts_for(manifest)).errors == []
