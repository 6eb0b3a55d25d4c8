"""The manifest's kubernetes section: what `moe-serve build --kuberay` needs beyond the manifest.

The pools say what runs where in Ray terms; this section says how the Ray nodes become pods of a
KubeRay RayService (cluster/kuberay.py): the image (it must hold moe-serve and vLLM, so there is
no default), namespace, service account, pod sizes, where the checkpoint is mounted, which
Kubernetes secrets feed the API keys and other variables, who may reach the pods, and (`rdma`,
cluster/manifest_rdma.py) the RDMA devices and settings of the engine pods.
Everything but `image` has a default; `moe-serve deploy` and `up` ignore the section.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.manifest_rdma import RDMASpec

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"  # namespaces, service accounts (RFC 1123 label)
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"  # secret and claim names
_SECRET_KEY = r"^[-._a-zA-Z0-9]{1,253}$"
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_LABEL_KEY = r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
_LABEL_VALUE = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"
_Labels = dict[Annotated[str, Field(pattern=_LABEL_KEY)], Annotated[str, Field(pattern=_LABEL_VALUE)]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class SecretKeyRef(_Strict):
    """One key of a Kubernetes Secret in the RayService's namespace."""

    name: Annotated[str, Field(pattern=_DNS_SUBDOMAIN)]
    """Secret name."""
    key: Annotated[str, Field(pattern=_SECRET_KEY)]
    """Key inside the secret."""


class ModelVolumeSpec(_Strict):
    """Where every pod finds the checkpoint (model.path must lie under mount_path)."""

    claim_name: Annotated[str, Field(pattern=_DNS_SUBDOMAIN)] | None = None
    """A PersistentVolumeClaim holding the weights (ReadOnlyMany, e.g. on a shared filesystem)."""
    host_path: str | None = None
    """Or a directory on every node holding a node-local copy."""
    mount_path: Annotated[str, Field(pattern=r"^/.*")] = "/models"
    """Where the volume appears in the pods."""

    @model_validator(mode="after")
    def _one_source(self) -> "ModelVolumeSpec":
        if (self.claim_name is None) == (self.host_path is None):
            raise ValueError("give exactly one of claim_name (a PersistentVolumeClaim) or host_path (a node directory)")
        return self


class Toleration(_Strict):
    """A pod toleration (Kubernetes' fields), e.g. for GPU nodes tainted nvidia.com/gpu:NoSchedule."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Exists"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None


class KubernetesSpec(_Strict):
    """How `moe-serve build --kuberay` lays the manifest out as a KubeRay RayService."""

    image: Annotated[str, Field(min_length=1, pattern=r"^\S+$")] | None = None
    """Container image of every Ray pod; it must hold moe-serve (with its gpu extra) and vLLM:
    build manifests/kuberay/Dockerfile. Required to generate a RayService."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Kubernetes' imagePullPolicy for that image."""
    namespace: Annotated[str, Field(pattern=_DNS_LABEL)] = "default"
    """Namespace of the RayService, its pods, secrets and monitoring objects."""
    service_account: Annotated[str, Field(pattern=_DNS_LABEL)] | None = None
    """ServiceAccount of the pods (the namespace's default when unset)."""
    gpus_per_node: Annotated[int, Field(ge=1, le=64)] = 8
    """GPUs of one Kubernetes node. Pools with expert_parallel.placement_strategy PACK/STRICT_PACK
    put as many ranks in one pod as these GPUs hold (one Ray node per machine, ranks on NVLink);
    other pools run one replica (or rank) per pod."""
    gpu_resource: Literal["nvidia.com/gpu", "amd.com/gpu"] = "nvidia.com/gpu"
    """Extended resource name of the GPUs (the device plugin's)."""
    memory_gib_per_cpu: Annotated[float, Field(gt=0, le=1024)] = 8.0
    """Host memory requested per CPU a pod reserves (placement.num_cpus of its ranks)."""
    head_num_cpus: Annotated[int, Field(ge=1, le=1024)] = 8
    """CPUs of the head pod: the Serve controller, HTTP proxy and the ingress replicas run there."""
    head_memory_gib: Annotated[float, Field(gt=0, le=4096)] = 32.0
    """Memory of the head pod."""
    node_selector: _Labels = Field(default_factory=dict)
    """Kubernetes node labels the worker pods need (e.g. {nvidia.com/gpu.product: NVIDIA-H200}).
    Pools' placement.node_labels are Ray node labels; they are given to the pods' Ray nodes."""
    tolerations: list[Toleration] = Field(default_factory=list)
    """Tolerations of the worker pods (e.g. for GPU nodes' taints)."""
    model_volume: ModelVolumeSpec | None = None
    """The checkpoint's volume, mounted in every pod (the ingress reads the tokenizer from it too)."""
    env: dict[Annotated[str, Field(pattern=_ENV_NAME)], str] = Field(default_factory=dict)
    """Plain environment variables of every pod."""
    secret_env: dict[Annotated[str, Field(pattern=_ENV_NAME)], SecretKeyRef] = Field(default_factory=dict)
    """Environment variables of every pod read from secrets (e.g. HF_TOKEN)."""
    api_keys_secret: SecretKeyRef = SecretKeyRef(name="moe-serve-api-keys", key="api-keys")
    """The secret holding the endpoint's API keys (comma-separated). It feeds http.auth.api_keys_env
    (as that variable) or http.auth.api_keys_file (mounted at that path)."""
    upgrade_strategy: Literal["NewCluster", "None"] = "NewCluster"
    """KubeRay's upgradeStrategy: NewCluster starts a second cluster and switches over (zero
    downtime, needs room for both); None updates the Serve config in place only."""
    network_policy: bool = True
    """Also write a NetworkPolicy: the HTTP port from anywhere, everything else only between the
    application's own pods, the operator and Prometheus."""
    operator_namespace: Annotated[str, Field(pattern=_DNS_LABEL)] = "default"
    """Namespace of the KubeRay operator (it talks to the head's dashboard port)."""
    prometheus_namespace: Annotated[str, Field(pattern=_DNS_LABEL)] = "monitoring"
    """Namespace of the Prometheus that scrapes the pods (the NetworkPolicy lets it in)."""
    pod_monitor_labels: _Labels = Field(default_factory=dict)
    """Labels of the PodMonitor, so that your Prometheus's podMonitorSelector picks it (e.g.
    {release: kube-prometheus-stack})."""
    rdma: RDMASpec | None = None
    """RDMA for the engine worker pods (devices, IPC_LOCK, host or Multus network, NCCL env), so
    that NCCL between pods and the KV transfer leave TCP; see cluster/manifest_rdma.py."""
