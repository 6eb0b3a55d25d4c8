"""Manifest loading: every shipped manifest is valid; every broken one fails before anything
starts, with a ManifestError whose issues name the field, the bad value and a fix."""

import copy
from pathlib import Path

import pytest
import yaml

from cluster.errors import ManifestError, ManifestIssue
from cluster.manifest import Accelerator, Manifest, PoolRole, load_manifest, parse_manifest

MANIFESTS = sorted((Path(__file__).resolve().parents[3] / "manifests").glob("*.yaml"))
LOCAL = next(p for p in MANIFESTS if p.name == "local.yaml")  # disaggregated: prefill + decode
COLOCATED = next(p for p in MANIFESTS if p.name == "local-colocated.yaml")
GPU = next(p for p in MANIFESTS if p.name == "deepseek-v3-h200.yaml")


def raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def broken(path: Path, mutate) -> ManifestError:
    """Apply `mutate` to a copy of a shipped manifest and return the error parsing it raises."""
    data = copy.deepcopy(raw(path))
    mutate(data)
    with pytest.raises(ManifestError) as info:
        parse_manifest(data, source="broken.yaml")
    return info.value


def only_issue(error: ManifestError) -> ManifestIssue:
    assert len(error.issues) == 1, error.issues
    return error.issues[0]


def assert_reported(error: ManifestError, issue: ManifestIssue) -> None:
    """The rendered message carries the source, the field, the value and the fix."""
    text = str(error)
    assert "broken.yaml" in text
    assert issue.field in text
    assert repr(issue.value) in text
    assert issue.fix and f"Fix: {issue.fix}" in text


def test_manifests_folder_is_not_empty():
    assert LOCAL in MANIFESTS and COLOCATED in MANIFESTS and GPU in MANIFESTS


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_shipped_manifest_loads(path):
    manifest = load_manifest(path)
    assert isinstance(manifest, Manifest)
    assert manifest.pools
    assert manifest.model.name


def test_local_manifest_values():
    manifest = load_manifest(LOCAL)
    assert manifest.name == "moe-local"
    assert manifest.accelerator is Accelerator.cpu
    assert manifest.model.path == "builtin://tiny-qwen3-moe"
    assert [n.name for n in manifest.local_cluster.nodes] == ["head", "prefill-0", "decode-0", "decode-1"]
    assert manifest.disaggregated
    prefill, decode = manifest.pool("prefill"), manifest.pool("decode")
    assert (prefill.role, decode.role) == (PoolRole.prefill, PoolRole.decode)
    assert manifest.pool_with_role(PoolRole.prefill) is prefill
    assert manifest.pool_with_role(PoolRole.decode) is decode
    assert prefill.placement.node_labels == {"moe-role": "prefill"}
    assert decode.placement.node_labels == {"moe-role": "decode"}
    # Decode must not satisfy prompts from its own prefix cache, or the transfer tests prove nothing.
    assert prefill.engine.enable_prefix_caching and not decode.engine.enable_prefix_caching
    assert prefill.engine.block_size == decode.engine.block_size
    # The default shows expert shards too: decode is a 2-rank group, one rank per decode node.
    assert prefill.expert_parallel is None
    assert (decode.expert_parallel.size, decode.expert_parallel.placement_strategy) == (2, "STRICT_SPREAD")
    assert manifest.model.dtype == "float32"  # token-identical EP (see the manifest's comment)
    kv = manifest.kv_transfer
    assert (kv.backend, kv.lease_s, kv.transfer_timeout_s, kv.failure_policy) == ("tcp", 30, 5, "recompute")
    assert not kv.allow_fault_injection  # tests opt in; any client could send the header
    with pytest.raises(KeyError):
        manifest.pool("nope")


def test_no_shipped_manifest_allows_fault_injection():
    for path in sorted(LOCAL.parent.glob("*.yaml")):
        assert not load_manifest(path).kv_transfer.allow_fault_injection, path.name


def test_colocated_manifest_values():
    manifest = load_manifest(COLOCATED)
    assert manifest.name == "moe-local-colocated"
    assert manifest.model == load_manifest(LOCAL).model  # the same model, for a fair benchmark
    assert [n.name for n in manifest.local_cluster.nodes] == ["head", "engine-0"]
    assert not manifest.disaggregated
    (pool,) = manifest.pools
    assert (pool.name, pool.role) == ("engine", PoolRole.colocated)
    assert pool.placement.node_labels == {"moe-role": "engine"}
    # No kv_transfer section: the defaults apply (and are unused), fault injection stays off.
    assert not manifest.kv_transfer.allow_fault_injection


def test_unknown_key_is_rejected_with_the_known_ones():
    error = broken(LOCAL, lambda d: d["pools"][0].update(replica=2))
    issue = only_issue(error)
    assert (issue.field, issue.value) == ("pools[0].replica", 2)
    assert issue.problem == "unknown field"
    assert "replicas" in issue.fix  # the fix lists the field the typo meant
    assert_reported(error, issue)


def test_unknown_top_level_key():
    issue = only_issue(broken(LOCAL, lambda d: d.update(modle={"name": "x"})))
    assert (issue.field, issue.value) == ("modle", {"name": "x"})
    assert "model" in issue.fix and "pools" in issue.fix


def test_unknown_key_in_nested_engine_settings():
    issue = only_issue(broken(LOCAL, lambda d: d["pools"][0]["engine"].update(tensor_parallel=2)))
    assert issue.field == "pools[0].engine.tensor_parallel"
    assert "tensor_parallel_size" in issue.fix


def test_negative_replicas():
    error = broken(LOCAL, lambda d: d["pools"][0].update(replicas=-1))
    issue = only_issue(error)
    assert (issue.field, issue.value) == ("pools[0].replicas", -1)
    assert "greater than or equal to 1" in issue.problem
    assert_reported(error, issue)


def test_wrong_type_names_field_and_value():
    issue = only_issue(broken(LOCAL, lambda d: d["model"].update(max_model_len="big")))
    assert (issue.field, issue.value) == ("model.max_model_len", "big")
    assert "Context length" in issue.fix  # the field's docstring explains what it wants


def test_duplicate_pool_names():
    error = broken(LOCAL, lambda d: d["pools"][1].update(name="prefill"))
    issue = only_issue(error)
    assert (issue.field, issue.value) == ("pools[1].name", "prefill")
    assert issue.problem == "duplicate pool name"
    assert_reported(error, issue)


def test_duplicate_local_node_names():
    issue = only_issue(broken(LOCAL, lambda d: d["local_cluster"]["nodes"].append({"name": "head"})))
    assert issue.field == "local_cluster.nodes[].name"
    assert issue.value == ["head", "prefill-0", "decode-0", "decode-1", "head"]


def test_node_labels_matching_no_local_node():
    error = broken(LOCAL, lambda d: d["pools"][0]["placement"].update(node_labels={"moe-role": "gpu"}))
    issue = only_issue(error)
    assert (issue.field, issue.value) == ("pools[0].placement.node_labels", {"moe-role": "gpu"})
    assert "local_cluster" in issue.fix
    assert_reported(error, issue)


def test_node_labels_must_all_match_one_node():
    # moe-role=prefill is on prefill-0 and zone=a on head: each label matches a node, no node both.
    def split_labels(d):
        d["local_cluster"]["nodes"][0]["labels"]["zone"] = "a"
        d["pools"][0]["placement"]["node_labels"] = {"moe-role": "prefill", "zone": "a"}

    issue = only_issue(broken(LOCAL, split_labels))
    assert issue.field == "pools[0].placement.node_labels"
    assert issue.value == {"moe-role": "prefill", "zone": "a"}


def test_gpus_on_a_cpu_manifest():
    error = broken(LOCAL, lambda d: d["pools"][0]["placement"].update(num_gpus=1))
    issue = only_issue(error)
    assert (issue.field, issue.value) == ("pools[0].placement.num_gpus", 1.0)
    assert "accelerator: gpu" in issue.fix
    assert_reported(error, issue)


def test_gpu_manifest_with_fewer_gpus_than_tensor_parallel_ranks():
    error = broken(GPU, lambda d: d["pools"][0]["placement"].update(num_gpus=4))
    issue = only_issue(error)
    assert (issue.field, issue.value) == ("pools[0].placement.num_gpus", 4.0)
    assert "tensor_parallel_size=8" in issue.problem
    assert_reported(error, issue)


def test_unknown_builtin_checkpoint_lists_the_known_ones():
    error = broken(LOCAL, lambda d: d["model"].update(path="builtin://nope"))
    issue = only_issue(error)
    assert (issue.field, issue.value) == ("model.path", "builtin://nope")
    assert "builtin://tiny-qwen3-moe" in issue.problem and "builtin://tiny-mixtral" in issue.problem
    assert_reported(error, issue)


def test_missing_model_says_what_to_add():
    error = broken(LOCAL, lambda d: d.pop("model"))
    issue = only_issue(error)
    assert (issue.field, issue.value) == ("model", None)
    assert issue.problem == "required field is missing"
    assert "name" in issue.fix and "path" in issue.fix


def test_missing_nested_required_field():
    issue = only_issue(broken(LOCAL, lambda d: d["model"].pop("path")))
    assert (issue.field, issue.value) == ("model.path", None)
    assert "builtin://" in issue.fix


def _pool(name: str, role: str, labels: dict) -> dict:
    return {"name": name, "role": role, "placement": {"node_labels": labels}}


LAYOUT_FIX = "declare one colocated pool, or one prefill pool and one decode pool"


@pytest.mark.parametrize("path, mutate, roles", [
    pytest.param(LOCAL, lambda d: d["pools"].append(_pool("prefill-b", "prefill", {"moe-role": "prefill"})),
                 ["decode", "prefill", "prefill"], id="two-prefill-pools"),
    pytest.param(LOCAL, lambda d: d["pools"].pop(1), ["prefill"], id="prefill-without-decode"),
    pytest.param(LOCAL, lambda d: d["pools"].pop(0), ["decode"], id="decode-without-prefill"),
    pytest.param(LOCAL, lambda d: d["pools"][1].update(role="prefill"), ["prefill", "prefill"],
                 id="two-prefill-no-decode"),
    pytest.param(COLOCATED, lambda d: d["pools"].append(_pool("prefill", "prefill", {"moe-role": "engine"})),
                 ["colocated", "prefill"], id="colocated-and-prefill"),
    pytest.param(LOCAL, lambda d: d["pools"].append(_pool("engine", "colocated", {"moe-role": "head"})),
                 ["colocated", "decode", "prefill"], id="colocated-and-prefill-and-decode"),
    pytest.param(COLOCATED, lambda d: d["pools"].append(_pool("engine-b", "colocated", {"moe-role": "engine"})),
                 ["colocated", "colocated"], id="two-colocated-pools"),
])
def test_unsupported_pool_layouts_are_rejected(path, mutate, roles):
    error = broken(path, mutate)
    issue = only_issue(error)
    assert (issue.field, issue.value) == ("pools[].role", roles)
    assert issue.problem == "unsupported pool layout"
    assert issue.fix == LAYOUT_FIX
    assert_reported(error, issue)


def test_prefill_and_decode_must_share_one_block_size():
    def mismatch(d):
        d["pools"][0]["engine"]["block_size"] = 16
        d["pools"][1]["engine"]["block_size"] = 32

    error = broken(LOCAL, mismatch)
    issue = only_issue(error)
    assert (issue.field, issue.value) == ("pools[].engine.block_size", [16, 32])  # prefill's, then decode's
    assert "block size" in issue.problem
    assert "same engine.block_size" in issue.fix
    assert_reported(error, issue)
    assert "16" in str(error) and "32" in str(error)


def test_block_size_set_on_one_side_only_is_a_mismatch():
    # Unset means vLLM's default, which the manifest cannot see: only equal explicit values match.
    issue = only_issue(broken(LOCAL, lambda d: d["pools"][1]["engine"].update(block_size=16)))
    assert (issue.field, issue.value) == ("pools[].engine.block_size", [None, 16])


def test_equal_block_sizes_are_accepted():
    data = raw(LOCAL)
    for pool in data["pools"]:
        pool["engine"]["block_size"] = 32
    manifest = parse_manifest(data)
    assert {pool.engine.block_size for pool in manifest.pools} == {32}


def test_kv_transfer_settings_are_validated():
    error = broken(LOCAL, lambda d: d["kv_transfer"].update(failure_policy="retry", lease_s=0))
    assert {i.field: i.value for i in error.issues} == {"kv_transfer.failure_policy": "retry",
                                                       "kv_transfer.lease_s": 0}
    issue = only_issue(broken(LOCAL, lambda d: d["kv_transfer"].update(backend="nixl")))
    assert (issue.field, issue.value) == ("kv_transfer.backend", "nixl")
    data = raw(LOCAL)
    data["kv_transfer"]["backend"] = "mooncake"
    assert parse_manifest(data, source="mooncake.yaml").kv_transfer.backend == "mooncake"


def test_several_problems_are_reported_together():
    def two_problems(d):
        d["pools"][0]["placement"]["num_gpus"] = 1
        d["pools"][0]["placement"]["node_labels"] = {"moe-role": "gpu"}

    error = broken(LOCAL, two_problems)
    assert {i.field for i in error.issues} == {"pools[0].placement.num_gpus", "pools[0].placement.node_labels"}


@pytest.mark.parametrize("data, type_name", [([1, 2], "list"), ("just text", "str"), (None, "NoneType")])
def test_non_mapping_top_level(data, type_name):
    with pytest.raises(ManifestError) as info:
        parse_manifest(data, source="top.yaml")
    issue = only_issue(info.value)
    assert (issue.field, issue.value) == ("<top level>", type_name)
    assert "mapping" in issue.problem


def test_empty_file_is_a_non_mapping(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    assert only_issue(info.value).value == "NoneType"
    assert info.value.source == str(path)


def test_bad_yaml_reports_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: moe-local\nmodel:\n  name: [unclosed\n  path: x\n")
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    issue = only_issue(info.value)
    assert issue.field == "<yaml>"
    assert issue.value.startswith("line 4, column ")
    assert "not valid YAML" in issue.problem
    assert str(path) in str(info.value)


def test_unreadable_path(tmp_path):
    path = tmp_path / "missing.yaml"
    with pytest.raises(ManifestError) as info:
        load_manifest(path)
    issue = only_issue(info.value)
    assert (issue.field, issue.value) == ("<file>", str(path))
    assert "No such file" in issue.problem


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ManifestError) as info:
        load_manifest(tmp_path)
    assert only_issue(info.value).field == "<file>"


def test_valid_manifest_written_to_disk_round_trips(tmp_path):
    path = tmp_path / "copy.yaml"
    path.write_text(LOCAL.read_text())
    assert load_manifest(path) == load_manifest(LOCAL)
