"""The manifest's kubernetes.rdma section: a fast path between engine pods on Kubernetes.

Without it a worker pod holds GPUs and nothing else, so NCCL (the collectives of expert-parallel
groups that span pods) and the KV transfer engines fall back to TCP sockets over the pod network,
and `kv_pool.protocol: rdma` cannot register memory. The section gives every engine worker pod
(not the head, which runs no engine) what RDMA needs there:

- the RDMA devices, as the extended resources of the cluster's RDMA device plugin (the plugin
  mounts /dev/infiniband/* into the pod): per pod (a shared HCA plugin) or per GPU (one NIC or
  virtual function per GPU rail);
- the IPC_LOCK capability: registering memory pins it, and the kernel allows pinning beyond
  RLIMIT_MEMLOCK only to a process with CAP_IPC_LOCK. Kubernetes has no field for the memlock
  ulimit, and container runtimes often leave it at 64 KiB or 8 MiB, far below the GiBs of KV
  cache and NCCL buffers registered; the capability makes that limit irrelevant;
- the network the NICs sit on: RoCE needs the NIC's interface inside the pod, either a Multus
  secondary network (`networks`) or the node's network namespace (`host_network`); InfiniBand
  works from the pod network once the devices are in the pod;
- NCCL/UCX/NVSHMEM settings (`env`), e.g. NCCL_IB_HCA and NCCL_SOCKET_IFNAME.

`rdma_issues` holds the checks that span fields (run when the manifest loads);
cluster/kuberay_rdma.py renders the section and checks what needs the pod layout.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, ConfigDict, Field

from cluster.errors import ManifestIssue

if TYPE_CHECKING:
    from cluster.manifest import Manifest

_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# A Multus network: [namespace/]NetworkAttachmentDefinition[@interface], as its annotation takes it.
_NETWORK = r"^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?/)?[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?(@[A-Za-z0-9_.-]{1,15})?$"
# An extended resource: a device plugin's domain/name (Kubernetes' qualified name with a prefix).
_EXTENDED_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/"
                                r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")  # kubernetes.gpu_resource's choices
_Amounts = dict[str, Annotated[int, Field(ge=1, le=1024)]]


class RDMASpec(BaseModel):
    """RDMA for the engine worker pods: devices, memory pinning, network and NCCL settings."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    resources_per_pod: _Amounts = Field(default_factory=dict)
    """Extended resources every engine worker pod requests (limits = requests), e.g.
    {rdma/ib: 1} for a shared-HCA device plugin (k8s-rdma-shared-dev-plugin, the NVIDIA Network
    Operator's rdma/rdma_shared_device_a): the names your RDMA device plugin serves."""
    resources_per_gpu: _Amounts = Field(default_factory=dict)
    """Extended resources per GPU of the pod, for one NIC (or SR-IOV virtual function) per GPU
    rail, e.g. {nvidia.com/sriov_rdma_vf: 1}: a pod of 8 ranks requests 8."""
    ipc_lock: bool = True
    """Add the IPC_LOCK capability to the worker containers, so that NCCL, Mooncake and NVSHMEM
    may pin (register) more memory than the container's memlock ulimit, which Kubernetes cannot
    set. Turn off only where the runtime already gives containers an unlimited memlock ulimit
    (`ulimit -l` in a pod says `unlimited`) and Pod Security forbids the capability."""
    host_network: bool = False
    """Run the worker pods in their node's network namespace (hostNetwork, dnsPolicy
    ClusterFirstWithHostNet), for RoCE NICs without a Multus network. Ray's ports are then the
    node's, so every worker pod must fill its node, and a NetworkPolicy cannot admit such pods:
    needs kubernetes.network_policy: false (firewall the nodes instead)."""
    networks: list[Annotated[str, Field(pattern=_NETWORK)]] = Field(default_factory=list)
    """Multus secondary networks of the worker pods ([namespace/]name[@interface] of a
    NetworkAttachmentDefinition, e.g. an SR-IOV or macvlan network over the RDMA NICs), as the
    k8s.v1.cni.cncf.io/networks annotation. The NetworkPolicy covers the pod network only."""
    env: dict[Annotated[str, Field(pattern=_ENV_NAME)], str] = Field(default_factory=dict)
    """Environment variables of the worker pods only: NCCL's (NCCL_IB_HCA: mlx5,
    NCCL_SOCKET_IFNAME: eth0, NCCL_IB_GID_INDEX for RoCE, ...), UCX's or NVSHMEM's."""


def rdma_issues(manifest: Manifest) -> list[ManifestIssue]:
    """What is wrong with kubernetes.rdma as a whole (empty without the section)."""
    k8s = manifest.kubernetes
    rdma = k8s.rdma
    if rdma is None:
        return []
    where = "kubernetes.rdma"
    issues: list[ManifestIssue] = []
    if not rdma.resources_per_pod and not rdma.resources_per_gpu:
        issues.append(ManifestIssue(
            f"{where}.resources_per_pod", {}, "no RDMA device requested: without the device plugin's resource the "
            "pods have no /dev/infiniband, and NCCL falls back to TCP sockets",
            "name your RDMA device plugin's resource, e.g. resources_per_pod: {rdma/ib: 1} (shared HCA) or "
            "resources_per_gpu: {nvidia.com/sriov_rdma_vf: 1} (a NIC per GPU)"))
    for part in ("resources_per_pod", "resources_per_gpu"):
        for name in getattr(rdma, part):
            problem = _resource_problem(name, k8s.gpu_resource)
            if problem:
                issues.append(ManifestIssue(f"{where}.{part}.{name}", name, problem[0], problem[1]))
    for name in sorted(set(rdma.resources_per_pod) & set(rdma.resources_per_gpu)):
        issues.append(ManifestIssue(
            f"{where}.resources_per_gpu.{name}", name, "also in resources_per_pod: a pod would request it twice",
            "keep it in one of them (per pod for a shared device, per GPU for one device per rail)"))
    if rdma.host_network and rdma.networks:
        issues.append(ManifestIssue(
            f"{where}.networks", rdma.networks, "host-network pods get no CNI networks, Multus's included",
            "use host_network: true or networks, not both"))
    if rdma.host_network and k8s.network_policy:
        issues.append(ManifestIssue(
            f"{where}.host_network", True, "a NetworkPolicy cannot admit host-network pods (their traffic comes "
            "from node addresses, not pods), so the workers could not reach the head's GCS",
            "set kubernetes.network_policy: false and firewall the nodes, or keep the pod network and give the "
            "RDMA NICs to the pods with networks: [a Multus network]"))
    for name in sorted(set(rdma.env) & (set(k8s.env) | set(k8s.secret_env))):
        issues.append(ManifestIssue(
            f"{where}.env.{name}", rdma.env[name], "also set in kubernetes.env or secret_env (every pod's)",
            "set it in one place: kubernetes.rdma.env for the engine pods only, kubernetes.env for all"))
    return issues


def _resource_problem(name: str, gpu_resource: str) -> tuple[str, str] | None:
    """(problem, fix) when `name` cannot be an RDMA device plugin's resource, else None."""
    if name in _GPU_RESOURCES or name == gpu_resource:
        return (f"the GPUs ({gpu_resource}) are requested from the pools' placement.num_gpus",
                "remove it here; name the RDMA device plugin's resource (e.g. rdma/ib)")
    if not _EXTENDED_RESOURCE.match(name) or len(name) > 253:
        return (("not a device plugin's resource name (domain/name, such as rdma/ib or nvidia.com/hca); cpu, "
                 "memory and hugepages are sized from the pools"),
                "use the resource name your RDMA device plugin advertises (kubectl describe node: Allocatable)")
    if name.partition("/")[0].endswith(("kubernetes.io", "k8s.io")):
        return ("resources in Kubernetes' own domains are not device plugins'",
                "use the resource name your RDMA device plugin advertises (kubectl describe node: Allocatable)")
    return None
