"""kubernetes.rdma (cluster/manifest_rdma.py) in a RayService: pure, a pod template in, one out.

Only engine worker pods get it (every worker group is a pool's; the head runs no engine): the
RDMA device plugin's resources in the container's requests and limits (equal, as Kubernetes
wants for devices; per-GPU amounts times the pod's GPUs), IPC_LOCK in the container's
capabilities, the Multus networks annotation or hostNetwork with the DNS policy that keeps
cluster names resolving, and the section's variables (merged into the container's env by
cluster/kuberay.py). `rdma_layout_issues` checks what needs the pods' shapes.
"""

from __future__ import annotations

import copy
from typing import Any

from cluster.errors import ManifestIssue
from cluster.kuberay_shape import PodShape
from cluster.manifest import Manifest
from cluster.manifest_rdma import RDMASpec

MULTUS_ANNOTATION = "k8s.v1.cni.cncf.io/networks"


def rdma_env(manifest: Manifest) -> dict[str, str]:
    """The variables the engine worker pods get beyond every pod's."""
    rdma = manifest.kubernetes.rdma
    return dict(rdma.env) if rdma else {}


def pod_rdma_resources(rdma: RDMASpec, num_gpus: int) -> dict[str, int]:
    """Extended resources of one worker pod holding `num_gpus` GPUs."""
    amounts = dict(rdma.resources_per_pod)
    amounts.update({name: per_gpu * num_gpus for name, per_gpu in rdma.resources_per_gpu.items() if num_gpus})
    return dict(sorted(amounts.items()))


def with_rdma(template: dict[str, Any], rdma: RDMASpec | None, num_gpus: int) -> dict[str, Any]:
    """A copy of a worker pod template (KubeRay's `template`) with the section applied; the
    template itself without it."""
    if rdma is None:
        return template
    template = copy.deepcopy(template)
    spec = template["spec"]
    container = spec["containers"][0]
    for part in ("requests", "limits"):
        container["resources"][part].update(
            {name: str(amount) for name, amount in pod_rdma_resources(rdma, num_gpus).items()})
    if rdma.ipc_lock:  # pinning memory for RDMA past the memlock ulimit (see RDMASpec.ipc_lock)
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    if rdma.host_network:
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"  # else the pod resolves with the node's DNS: no head service
    if rdma.networks:
        template["metadata"].setdefault("annotations", {})[MULTUS_ANNOTATION] = ",".join(rdma.networks)
    return template


def rdma_layout_issues(manifest: Manifest, shapes: list[PodShape]) -> list[ManifestIssue]:
    """What the pods' layout makes impossible: host-network pods sharing a node (Ray's fixed
    ports, 8080 for metrics among them, would collide), and an RDMA KV pool whose pods have no
    RDMA devices."""
    k8s, issues = manifest.kubernetes, []
    rdma = k8s.rdma
    if rdma is not None and rdma.host_network:
        partial = [f"{shape.pool} ({shape.num_gpus} GPUs)" for shape in shapes if shape.num_gpus != k8s.gpus_per_node]
        if partial:
            issues.append(ManifestIssue(
                "kubernetes.rdma.host_network", True,
                f"host-network pods must each fill a node of {k8s.gpus_per_node} GPUs, or two of them share the "
                f"node's ports; these pools' pods do not: {', '.join(partial)}",
                "give those pools pods of a whole node (expert_parallel.placement_strategy: PACK with size a "
                "multiple of gpus_per_node, or num_gpus = gpus_per_node), or use networks (Multus) instead"))
    if manifest.kv_pool.enabled and manifest.kv_pool.protocol == "rdma" and rdma is None:
        issues.append(ManifestIssue(
            "kubernetes.rdma", None, "kv_pool.protocol is rdma, and the engine pods would have no RDMA device "
            "nor the IPC_LOCK capability to register the pool's memory",
            "add kubernetes.rdma with your RDMA device plugin's resource (e.g. resources_per_pod: {rdma/ib: 1}), "
            "or set kv_pool.protocol: tcp"))
    if manifest.disaggregated and manifest.kv_transfer.protocol == "rdma" and rdma is None:
        issues.append(ManifestIssue(
            "kubernetes.rdma", None, "kv_transfer.protocol is rdma, and the engine pods would have no RDMA "
            "device nor the IPC_LOCK capability to register their KV staging",
            "add kubernetes.rdma with your RDMA device plugin's resource (e.g. resources_per_pod: {rdma/ib: 1}), "
            "or set kv_transfer.protocol: tcp"))
    return issues


def rdma_header_lines(manifest: Manifest) -> list[str]:
    """The generated file's "Before applying" lines for the section (none without it)."""
    rdma = manifest.kubernetes.rdma
    if rdma is None:
        return []
    lines = []
    privileged = ["IPC_LOCK"] * rdma.ipc_lock + ["hostNetwork"] * rdma.host_network
    if privileged:
        lines.append(f"  kubectl label namespace {manifest.kubernetes.namespace} "
                     f"pod-security.kubernetes.io/enforce=privileged   # where Pod Security is enforced: "
                     f"{' and '.join(privileged)} {'are' if len(privileged) > 1 else 'is'} beyond baseline")
    asks = [f"{name}: {amount} per pod" for name, amount in sorted(rdma.resources_per_pod.items())]
    asks += [f"{name}: {amount} per GPU" for name, amount in sorted(rdma.resources_per_gpu.items())]
    lines.append(f"RDMA (kubernetes.rdma): the engine pods request {', '.join(asks)}; that device plugin (and "
                 "nvidia-peermem, for GPUDirect RDMA) must run on the GPU nodes.")
    return lines
