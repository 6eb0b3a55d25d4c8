"""kubernetes.rdma: the schema refuses what cannot work (naming the field and the fix), and the
RayService gives the engine worker pods, never the head, the RDMA devices, IPC_LOCK, network and
NCCL variables, in documents that pass KubeRay's vendored CRD schema."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from cluster.errors import ManifestError
from cluster.kuberay import rayservice_for_manifest, render_rayservice
from cluster.kuberay_rdma import MULTUS_ANNOTATION
from cluster.kuberay_validate import validate_rayservice
from cluster.manifest import load_manifest, parse_manifest
from cluster.serve_config import serve_config
from tests.unit.cluster.test_manifest import assert_reported, broken, only_issue

REPO = Path(__file__).resolve().parents[3]
PD_EP = REPO / "manifests" / "deepseek-v3-h200-disagg-ep.yaml"
COLOCATED = REPO / "manifests" / "deepseek-v3-h200.yaml"


def _data(path: Path = PD_EP, **rdma) -> dict:
    data = yaml.safe_load(path.read_text())
    if rdma:
        data["kubernetes"]["rdma"] = rdma
    return data


def _rdma(mutate) -> ManifestError:
    def apply(data):
        mutate(data["kubernetes"]["rdma"], data["kubernetes"])
    return broken(PD_EP, apply)


def _doc(data: dict) -> dict:
    manifest = parse_manifest(data)
    return rayservice_for_manifest(manifest, serve_config(manifest, data))


def _pods(doc: dict) -> tuple[dict, list[dict]]:
    cluster = doc["spec"]["rayClusterConfig"]
    return cluster["headGroupSpec"]["template"], [group["template"] for group in cluster["workerGroupSpecs"]]


def _env(template: dict) -> dict[str, str]:
    return {item["name"]: item.get("value") for item in template["spec"]["containers"][0]["env"]}


# --- the schema ---------------------------------------------------------------------------------

def test_the_pd_example_asks_for_rdma_and_the_colocated_one_does_not():
    rdma = load_manifest(PD_EP).kubernetes.rdma
    assert rdma is not None and rdma.resources_per_pod == {"rdma/ib": 1} and rdma.ipc_lock
    assert not rdma.host_network and rdma.env["NCCL_IB_HCA"] == "mlx5"
    assert load_manifest(COLOCATED).kubernetes.rdma is None


def test_a_section_without_devices_is_refused_with_the_device_plugin_fix():
    error = _rdma(lambda rdma, _: rdma.pop("resources_per_pod"))
    issue = only_issue(error)
    assert issue.field == "kubernetes.rdma.resources_per_pod" and "falls back to TCP" in issue.problem
    assert "rdma/ib" in issue.fix
    assert_reported(error, issue)


@pytest.mark.parametrize("name, says", [
    ("ib", "not a device plugin's resource name"),
    ("memory", "not a device plugin's resource name"),
    ("nvidia.com/gpu", "requested from the pools' placement.num_gpus"),
    ("example.kubernetes.io/nic", "Kubernetes' own domains"),
])
def test_a_resource_no_rdma_device_plugin_serves_is_refused_naming_it(name, says):
    error = _rdma(lambda rdma, _: rdma.update(resources_per_gpu={name: 1}))
    issue = only_issue(error)
    assert issue.field == f"kubernetes.rdma.resources_per_gpu.{name}" and says in issue.problem
    assert_reported(error, issue)


def test_one_resource_in_both_maps_and_zero_amounts_are_refused():
    issue = only_issue(_rdma(lambda rdma, _: rdma.update(resources_per_gpu={"rdma/ib": 1})))
    assert issue.field == "kubernetes.rdma.resources_per_gpu.rdma/ib" and "twice" in issue.problem
    issue = only_issue(_rdma(lambda rdma, _: rdma.update(resources_per_pod={"rdma/ib": 0})))
    assert issue.field == "kubernetes.rdma.resources_per_pod.rdma/ib" and "greater than or equal to 1" in issue.problem


def test_a_host_network_needs_the_network_policy_off_and_no_multus_networks():
    error = _rdma(lambda rdma, _: rdma.update(host_network=True))
    issue = only_issue(error)
    assert issue.field == "kubernetes.rdma.host_network" and "NetworkPolicy cannot admit" in issue.problem
    assert "network_policy: false" in issue.fix
    assert_reported(error, issue)

    def both(rdma, k8s):
        rdma.update(host_network=True, networks=["sriov-rdma"])
        k8s["network_policy"] = False
    issue = only_issue(_rdma(both))
    assert issue.field == "kubernetes.rdma.networks" and "not both" in issue.fix


def test_a_variable_set_for_every_pod_and_for_engine_pods_is_refused():
    def twice(rdma, k8s):
        k8s["env"] = {"NCCL_IB_HCA": "mlx5_0"}
    issue = only_issue(_rdma(twice))
    assert issue.field == "kubernetes.rdma.env.NCCL_IB_HCA" and "one place" in issue.fix


def test_typos_and_malformed_values_name_the_field():
    issue = only_issue(_rdma(lambda rdma, _: rdma.update(host_netwrok=True)))
    assert issue.field == "kubernetes.rdma.host_netwrok" and "host_network" in issue.fix
    assert only_issue(_rdma(lambda rdma, _: rdma.update(networks=["Bad Net"]))).field == "kubernetes.rdma.networks[0]"
    assert only_issue(_rdma(lambda rdma, _: rdma["env"].update({"NCCL-IB": "x"}))).field.startswith(
        "kubernetes.rdma.env.NCCL-IB")


# --- the RayService -----------------------------------------------------------------------------

def test_the_pd_example_gives_every_engine_pod_rdma_and_the_head_nothing():
    doc = _doc(_data())
    assert validate_rayservice(doc) == []
    head, workers = _pods(doc)
    assert len(workers) == 2
    for template in workers:
        container = template["spec"]["containers"][0]
        for part in ("requests", "limits"):
            assert container["resources"][part]["rdma/ib"] == "1"
        assert container["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert _env(template)["NCCL_IB_HCA"] == "mlx5" and _env(template)["NCCL_SOCKET_IFNAME"] == "eth0"
        assert "MOE_SERVE_API_KEYS" in _env(template)  # every pod's variables stay
        assert "hostNetwork" not in template["spec"] and "annotations" not in template["metadata"]
    head_container = head["spec"]["containers"][0]
    assert "rdma/ib" not in head_container["resources"]["limits"] and "securityContext" not in head_container
    assert not any(name.startswith("NCCL_") for name in _env(head))


def test_per_gpu_resources_scale_with_the_pods_gpus():
    data = _data(resources_per_gpu={"nvidia.com/sriov_rdma_vf": 1})
    data["pools"][1]["expert_parallel"]["placement_strategy"] = "STRICT_SPREAD"  # decode: a pod per rank
    doc = _doc(data)
    assert validate_rayservice(doc) == []
    prefill, decode = (template["spec"]["containers"][0]["resources"] for template in _pods(doc)[1])
    assert prefill["limits"]["nvidia.com/sriov_rdma_vf"] == prefill["requests"]["nvidia.com/sriov_rdma_vf"] == "8"
    assert decode["limits"]["nvidia.com/sriov_rdma_vf"] == "1"


def test_a_host_network_on_whole_node_pods_renders_valid_and_the_header_says_what_it_needs():
    data = _data(resources_per_pod={"rdma/ib": 1}, host_network=True)
    data["kubernetes"]["network_policy"] = False
    doc = _doc(data)
    assert validate_rayservice(doc) == []
    head, workers = _pods(doc)
    for template in workers:
        assert template["spec"]["hostNetwork"] is True
        assert template["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "hostNetwork" not in head["spec"]
    text = render_rayservice(doc, "x.yaml")
    assert ("kubectl label namespace moe-serve pod-security.kubernetes.io/enforce=privileged   # where Pod Security "
            "is enforced: IPC_LOCK and hostNetwork are beyond baseline") in text
    assert "the engine pods request rdma/ib: 1 per pod" in text
    assert [d["kind"] for d in yaml.safe_load_all(text)] == ["RayService", "PodMonitor", "PrometheusRule"]


def test_host_network_pods_that_would_share_a_node_are_refused_naming_the_pool():
    data = _data(resources_per_pod={"rdma/ib": 1}, host_network=True)
    data["kubernetes"]["network_policy"] = False
    data["pools"][1]["expert_parallel"]["placement_strategy"] = "SPREAD"  # decode pods of 1 GPU on 8-GPU nodes
    with pytest.raises(ManifestError) as caught:
        _doc(data)
    (issue,) = caught.value.issues
    assert issue.field == "kubernetes.rdma.host_network" and "decode (1 GPUs)" in issue.problem
    assert "prefill" not in issue.problem and "networks" in issue.fix


def test_multus_networks_become_the_worker_pods_annotation():
    doc = _doc(_data(resources_per_pod={"rdma/ib": 1}, networks=["sriov-rdma", "net-ops/roce-b@net2"], ipc_lock=False))
    assert validate_rayservice(doc) == []
    head, workers = _pods(doc)
    for template in workers:
        assert template["metadata"]["annotations"] == {MULTUS_ANNOTATION: "sriov-rdma,net-ops/roce-b@net2"}
        assert "securityContext" not in template["spec"]["containers"][0]
    assert "annotations" not in head["metadata"]
    assert "pod-security" not in render_rayservice(doc, "x.yaml")  # nothing beyond baseline asked


def test_an_rdma_kv_pool_without_the_section_is_refused_at_build():
    data = _data()
    del data["kubernetes"]["rdma"]
    data["kv_pool"] = {"enabled": True, "protocol": "rdma"}
    data["kv_transfer"]["protocol"] = "tcp"  # this test is about the pool's
    with pytest.raises(ManifestError) as caught:
        _doc(data)
    (issue,) = caught.value.issues
    assert issue.field == "kubernetes.rdma" and "kv_pool.protocol: tcp" in issue.fix
    data["kubernetes"]["rdma"] = {"resources_per_pod": {"rdma/ib": 1}}
    assert validate_rayservice(_doc(data)) == []


def test_rdma_kv_transfer_without_the_section_is_refused_at_build():
    data = _data()
    del data["kubernetes"]["rdma"]
    assert data["kv_transfer"]["protocol"] == "rdma"  # the P/D GPU example's
    with pytest.raises(ManifestError) as caught:
        _doc(data)
    (issue,) = caught.value.issues
    assert issue.field == "kubernetes.rdma" and "kv_transfer.protocol: tcp" in issue.fix


def test_the_schema_check_catches_a_hand_edited_rdma_part():
    doc = _doc(_data())

    def broken_doc(change) -> list[str]:
        copied = copy.deepcopy(doc)
        change(copied["spec"]["rayClusterConfig"]["workerGroupSpecs"][1]["template"])
        return validate_rayservice(copied)

    path = "$.spec.rayClusterConfig.workerGroupSpecs[1].template.spec"
    assert f"{path}.containers[0].securityContext.capabilities.add: 'IPC_LOCK' is not of type 'array'" in broken_doc(
        lambda t: t["spec"]["containers"][0]["securityContext"]["capabilities"].update(add="IPC_LOCK"))
    assert any(p.startswith(f"{path}: unknown field 'hostNetworking'") for p in broken_doc(
        lambda t: t["spec"].update(hostNetworking=True)))
    assert any(p.startswith(f"{path}.containers[0].resources.limits: extended resource 'rdma/ib' must be in limits")
               for p in broken_doc(lambda t: t["spec"]["containers"][0]["resources"]["limits"].pop("rdma/ib")))
