"""Manifest sections beyond the layout: the KV pool, admission, the HTTP endpoint's exposure and
front, and decode-first disaggregation; each refused setting names its field and the fix.
(The layout, types and file handling: test_manifest.py, whose helpers these share.)"""

from __future__ import annotations

import copy

import pytest

from cluster.errors import ManifestError
from cluster.manifest import PoolRole, load_manifest, parse_manifest
from tests.unit.cluster.test_manifest import LOCAL, MANIFESTS, assert_reported, broken, only_issue, raw


def test_the_default_manifest_uses_the_kv_pool():
    pool = load_manifest(LOCAL).kv_pool
    assert pool.enabled and pool.backend == "mooncake" and pool.protocol == "tcp" and pool.segment_mib == 256


def test_kv_pool_over_rdma_on_a_cpu_manifest_is_refused_with_the_fix():
    error = broken(LOCAL, lambda d: d["kv_pool"].update(protocol="rdma"))
    issue = only_issue(error)
    assert issue.field == "kv_pool.protocol" and "tcp" in issue.fix
    assert_reported(error, issue)


def test_kv_pool_segment_below_mooncakes_minimum_is_refused():
    error = broken(LOCAL, lambda d: d["kv_pool"].update(segment_mib=8))
    assert "kv_pool.segment_mib" in str(error)


def test_prefill_may_contribute_no_pool_memory_but_not_less_than_mooncakes_minimum():
    spec = parse_manifest({**raw(LOCAL), "kv_pool": {**raw(LOCAL)["kv_pool"], "prefill_segment_mib": 0}}).kv_pool
    assert (spec.segment_mib_for("prefill"), spec.segment_mib_for("decode"), spec.segment_mib_for("colocated")) \
        == (0, 256, 256)
    assert load_manifest(LOCAL).kv_pool.segment_mib_for("prefill") == load_manifest(LOCAL).kv_pool.segment_mib
    error = broken(LOCAL, lambda d: d["kv_pool"].update(prefill_segment_mib=8))
    issue = only_issue(error)
    assert issue.field == "kv_pool.prefill_segment_mib" and "at least 16" in str(error)
    # What each engine's connector is given: its own role's segment, the same master and keys.
    from deployments.builder import engine_kv_settings

    address = {"master_address": "10.0.0.1:50051", "metadata_url": "http://10.0.0.1:8080/metadata"}
    manifest = parse_manifest({**raw(LOCAL), "kv_pool": {**raw(LOCAL)["kv_pool"], "prefill_segment_mib": 0}})
    prefill, decode = (engine_kv_settings(manifest, address, "secret", role)["pool"] for role in ("prefill", "decode"))
    assert (prefill["segment_bytes"], decode["segment_bytes"]) == (0, 256 << 20)
    assert {k: v for k, v in prefill.items() if k != "segment_bytes"} == \
        {k: v for k, v in decode.items() if k != "segment_bytes"}


def test_fractional_cpu_kv_cache_is_refused_before_vllm_fails_on_it():
    error = broken(LOCAL, lambda d: d["pools"][0]["engine"].update(cpu_kvcache_space_gib=0.5))
    assert "cpu_kvcache_space_gib" in str(error)


def test_admission_limits_follow_the_serving_pool_at_its_largest_and_split_over_ingress_replicas():
    manifest = load_manifest(next(p for p in MANIFESTS if p.name == "local-autoscaling.yaml"))
    decode = manifest.pool_with_role(PoolRole.decode)
    limits = manifest.admission.limits_per_ingress(decode, ingress_replicas=2)
    engines = decode.autoscaling.max_replicas * decode.ranks_per_replica
    assert limits["max_running"] == -(-engines * decode.engine.max_num_seqs // 2)
    assert limits["max_queued"] == -(-engines * manifest.admission.max_queued_per_replica // 2)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "serve.internal"])
def test_an_endpoint_beyond_loopback_needs_required_api_keys_or_a_stated_gateway(host):
    def open_to_the_network(data):
        data["http"]["host"] = host

    issue = only_issue(broken(LOCAL, open_to_the_network))
    assert issue.field == "http" and f"host {host} serves other machines" in issue.problem
    assert "required: true" in issue.problem and "allow_unauthenticated" in issue.problem
    gatewayed = copy.deepcopy(raw(LOCAL))
    gatewayed["http"].update(host=host, auth={"allow_unauthenticated": True})
    assert parse_manifest(gatewayed).http.host == host
    keyed = copy.deepcopy(raw(LOCAL))
    keyed["http"].update(host=host, auth={"api_keys_env": "MOE_SERVE_API_KEYS", "required": True})
    assert parse_manifest(keyed).http.auth.required


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_a_loopback_endpoint_may_stay_open(host):
    data = copy.deepcopy(raw(LOCAL))
    data["http"]["host"] = host
    assert not parse_manifest(data).http.auth.enabled


def test_the_front_is_haproxy_by_default_and_each_front_becomes_its_ray_environment():
    from cluster.manifest_http import missing_serve_environment, serve_environment

    haproxy = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
    manifest = parse_manifest(raw(LOCAL))
    assert manifest.http.front == "haproxy"
    assert serve_environment(manifest.http) == haproxy
    data = copy.deepcopy(raw(LOCAL))
    data["http"]["front"] = "serve_proxy"
    assert serve_environment(parse_manifest(data).http) == {}
    data["http"]["throughput_optimized"] = True
    assert serve_environment(parse_manifest(data).http) == {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    # deploy warns about what a cluster's environment lacks (or sets otherwise)
    assert missing_serve_environment(manifest.http, {}) == haproxy
    assert missing_serve_environment(manifest.http, {**haproxy, "RAY_SERVE_ENABLE_HA_PROXY": "0"}) == \
        {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
    assert missing_serve_environment(manifest.http, dict(haproxy)) == {}


def test_an_unknown_front_is_refused_naming_the_choices():
    data = copy.deepcopy(raw(LOCAL))
    data["http"]["front"] = "nginx"
    with pytest.raises(ManifestError, match=r"http\.front.*haproxy.*serve_proxy"):
        parse_manifest(data)


def test_local_prefill_by_hit_fraction_needs_to_know_what_decode_caches():
    data = copy.deepcopy(raw(LOCAL))
    data["kv_transfer"]["local_prefill_hit_fraction"] = 0.8
    decode = next(p for p in data["pools"] if p["role"] == "decode")
    decode["engine"]["enable_prefix_caching"] = False
    with pytest.raises(ManifestError, match=r"kv_transfer\.local_prefill_hit_fraction.*enable_prefix_caching"):
        parse_manifest(data)
    decode["engine"]["enable_prefix_caching"] = True
    decode["routing"] = {"policy": "prefix"}
    assert parse_manifest(data).kv_transfer.local_prefill_hit_fraction == 0.8
    data["kv_transfer"]["local_prefill_hit_fraction"] = 1.5
    with pytest.raises(ManifestError, match=r"local_prefill_hit_fraction"):
        parse_manifest(data)


def test_only_the_prefill_pool_lends_kv_and_the_transfer_port_is_sized_from_the_decode_side():
    from cluster.manifest import PoolRole
    from deployments.builder import MIN_CONNECTIONS, engine_kv_settings, transfer_connections

    address = {"master_address": "10.0.0.1:50051", "metadata_url": "http://10.0.0.1:8080/metadata"}
    manifest = load_manifest(LOCAL)
    lends = {role: engine_kv_settings(manifest, address, "ab" * 32, role)["lends_kv"]
             for role in (PoolRole.prefill, PoolRole.decode)}
    assert lends == {PoolRole.prefill: True, PoolRole.decode: False}
    colocated = parse_manifest({**raw(LOCAL), "pools": [{**raw(LOCAL)["pools"][1], "name": "engine",
                                                         "role": "colocated", "expert_parallel": None}]})
    settings = engine_kv_settings(colocated, address, "ab" * 32, PoolRole.colocated)
    assert settings["lends_kv"] is False and settings["grant_secret"] == "ab" * 32
    # Every decode worker at full scale may hold a pull pool's connections to one prefill engine.
    bigger = parse_manifest({**raw(LOCAL), "pools": [raw(LOCAL)["pools"][0],
                                                      {**raw(LOCAL)["pools"][1], "replicas": 40}]})
    assert transfer_connections(manifest) == MIN_CONNECTIONS
    assert transfer_connections(bigger) == 40 * 2 * 6 + 16 > 256


GPU_COLOCATED = next(p for p in MANIFESTS if p.name == "deepseek-v3-h200.yaml")
GPU_DISAGG = next(p for p in MANIFESTS if p.name == "deepseek-v3-h200-disagg-ep.yaml")


def test_tensor_parallelism_with_the_kv_pool_is_accepted():
    # Each TP worker serves on its own KV port and stores its own shard under its rank's key.
    manifest = parse_manifest({**raw(GPU_COLOCATED), "kv_pool": {"enabled": True}})
    assert manifest.pools[0].engine.tensor_parallel_size == 8 and manifest.kv_pool.enabled


def _no_ep_prefill(d, tp=8):
    prefill = d["pools"][0]
    prefill.pop("expert_parallel")
    prefill["engine"]["tensor_parallel_size"] = tp
    prefill["placement"]["num_gpus"] = tp


def test_prefill_and_decode_with_different_tensor_parallel_sizes_are_refused_naming_both():
    def tp_prefill_ep_decode_off(d):
        _no_ep_prefill(d)
        d["pools"][1].pop("expert_parallel")  # decode: TP 1, one worker per engine

    error = broken(GPU_DISAGG, tp_prefill_ep_decode_off)
    issue = only_issue(error)
    assert (issue.field, issue.value) == ("pools[1].engine.tensor_parallel_size", 1)
    assert "tensor_parallel_size 8" in issue.problem and "not implemented" in issue.problem
    assert "same tensor_parallel_size" in issue.fix
    assert_reported(error, issue)


def test_an_expert_parallel_prefill_and_a_tensor_parallel_decode_are_refused():
    def tp_decode(d):  # prefill keeps expert parallelism (TP 1 per rank)
        decode = d["pools"][1]
        decode.pop("expert_parallel")
        decode["engine"]["tensor_parallel_size"] = 2
        decode["placement"]["num_gpus"] = 2

    issue = only_issue(broken(GPU_DISAGG, tp_decode))
    assert (issue.field, issue.value) == ("pools[1].engine.tensor_parallel_size", 2)
    assert "tensor_parallel_size 1" in issue.problem


def test_prefill_and_decode_with_the_same_tensor_parallel_size_are_accepted():
    def both_tp(d):
        _no_ep_prefill(d, tp=4)
        decode = d["pools"][1]
        decode.pop("expert_parallel")
        decode["engine"]["tensor_parallel_size"] = 4
        decode["placement"]["num_gpus"] = 4

    data = raw(GPU_DISAGG)
    both_tp(data)
    manifest = parse_manifest(data)
    assert [p.engine.tensor_parallel_size for p in manifest.pools] == [4, 4]


def test_an_expert_parallel_pool_with_tensor_parallelism_gets_one_issue_not_two():
    def tp_decode(d):
        d["pools"][1]["engine"]["tensor_parallel_size"] = 2
        d["pools"][1]["placement"]["num_gpus"] = 2

    issue = only_issue(broken(GPU_DISAGG, tp_decode))
    assert (issue.field, issue.value) == ("pools[1].engine.tensor_parallel_size", 2)
    assert "expert-parallel" in issue.problem


def test_rdma_for_kv_transfer_needs_the_mooncake_backend_and_a_gpu_manifest():
    error = broken(GPU_DISAGG, lambda d: d["kv_transfer"].update(backend="tcp"))
    issue = only_issue(error)
    assert (issue.field, issue.value) == ("kv_transfer.protocol", "rdma")
    assert "tcp only" in issue.problem and "backend: mooncake" in issue.fix
    assert_reported(error, issue)
    manifest = load_manifest(GPU_DISAGG)
    assert (manifest.kv_transfer.backend, manifest.kv_transfer.protocol) == ("mooncake", "rdma")
    issue = only_issue(broken(LOCAL, lambda d: d.setdefault("kv_transfer", {}).update(
        backend="mooncake", protocol="rdma")))
    assert (issue.field, issue.problem) == ("kv_transfer.protocol", "RDMA on a cpu manifest")


def test_a_disk_tier_needs_an_absolute_path_and_a_capacity():
    def with_disk(disk):
        return lambda d: d["kv_pool"].update(disk=disk)

    error = str(broken(LOCAL, with_disk({"path": "kv-cache", "capacity_gib": 4})))
    assert "kv_pool.disk.path" in error and "absolute path" in error and "/mnt/nvme/moe-serve-kv" in error
    assert "kv_pool.disk.path" in str(broken(LOCAL, with_disk({"path": "/data/../etc", "capacity_gib": 4})))
    assert "kv_pool.disk.capacity_gib" in str(broken(LOCAL, with_disk({"path": "/data/kv", "capacity_gib": 0})))
    assert "kv_pool.disk.capacity_gib" in str(broken(LOCAL, with_disk({"path": "/data/kv"})))


def test_the_disk_tier_reaches_every_engine_with_its_own_folder():
    from deployments.builder import engine_kv_settings
    from deployments.engine.llm_server import connector_settings

    manifest = load_manifest(next(p for p in MANIFESTS if p.name == "local-long-context.yaml"))
    address = {"master_address": "127.0.0.1:1", "metadata_url": "http://127.0.0.1:2/metadata"}
    pool = engine_kv_settings(manifest, address, "ab" * 32, "decode")["pool"]
    assert pool["disk_dir"] == "/var/tmp/moe-serve-kv/moe-long" and pool["disk_bytes"] == 4 << 30
    settings = connector_settings({**engine_kv_settings(manifest, address, "ab" * 32, "decode"), "host": "127.0.0.1"},
                                  "decode-7f3a")
    assert settings["pool"]["disk_dir"] == "/var/tmp/moe-serve-kv/moe-long/decode-7f3a"
