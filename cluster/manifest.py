"""The manifest: one YAML file that says what model to serve, on which pools, against which SLO.

Loaded into pydantic models and validated before anything starts. Unknown keys are errors
(a typo must not silently fall back to a default), and every error names the field, the value
and the fix. `moe-serve plan MANIFEST` prints what a valid manifest would run where.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from cluster.errors import ManifestError, ManifestIssue
from cluster.manifest_autoscaling import AutoscalingSpec, PoolAutoscalingSpec, autoscaling_issues
from cluster.manifest_http import HTTPSpec
from cluster.manifest_kv import KVPoolSpec, KVTransferSpec, kv_connector_issues
from cluster.manifest_kubernetes import KubernetesSpec
from cluster.manifest_rdma import rdma_issues
from cluster.manifest_routing import AdmissionSpec, RoutingSpec
from cluster.manifest_timeouts import RequestTimeoutsSpec, timeout_issues

_LABEL_KEY = r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,62}[A-Za-z0-9])?$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class Accelerator(str, Enum):
    cpu = "cpu"
    gpu = "gpu"


class PoolRole(str, Enum):
    colocated = "colocated"
    """Prefill and decode in one engine per replica."""
    prefill = "prefill"
    decode = "decode"


class ModelSpec(_Strict):
    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9._:/-]+$")]
    """Model id served on /v1/models and expected in requests' "model" field."""
    path: Annotated[str, Field(min_length=1)]
    """Checkpoint directory (readable at the same path on every node), or builtin://NAME for a
    tiny checkpoint built locally (tiny-qwen3-moe, tiny-mixtral, tiny-deepseek-v3, tiny-glm4-moe)."""
    max_model_len: Annotated[int, Field(ge=16, le=1_048_576)] = 2048
    """Context length in tokens (prompt + output); longer requests are rejected with HTTP 400."""
    dtype: Annotated[str, Field(pattern=r"^(auto|bfloat16|float16|float32)$")] = "bfloat16"
    """Weight and activation dtype: auto, bfloat16, float16 or float32."""
    quantization: Literal["fp8"] | None = None
    """Quantize the weights when loading (vLLM's `quantization`), e.g. fp8 for a bf16 checkpoint.
    Leave unset for checkpoints that are already quantized (DeepSeek-V3's FP8 release): vLLM
    reads their quantization_config."""
    tool_parser: Annotated[str, Field(pattern=r"^[a-z0-9_-]+$")] | None = None
    """vLLM's tool-call parser for this model (e.g. hermes for Qwen3, deepseek_v3, glm45): turns
    on `tools` with tool_choice auto and a named function. Without it: none/required only."""
    reasoning_parser: Annotated[str, Field(pattern=r"^[a-z0-9_-]+$")] | None = None
    """vLLM's reasoning parser (e.g. qwen3, deepseek_r1, glm45): separates `reasoning` from content."""

    @field_validator("path")
    @classmethod
    def _known_builtin(cls, value: str) -> str:
        from cluster.checkpoints import BUILTIN_SCHEME, SPECS

        if value.startswith(BUILTIN_SCHEME) and value[len(BUILTIN_SCHEME):] not in SPECS:
            known = ", ".join(BUILTIN_SCHEME + name for name in SPECS)
            raise ValueError(f"unknown builtin checkpoint; use one of {known} or a directory")
        return value

    @field_validator("tool_parser", "reasoning_parser")
    @classmethod
    def _known_parser(cls, value: str | None, info: ValidationInfo) -> str | None:
        from cluster.vllm_parsers import unknown_parser

        kind = "tool" if info.field_name == "tool_parser" else "reasoning"
        problem = None if value is None else unknown_parser(kind, value)
        if problem:
            raise ValueError(problem)
        return value


class EngineSpec(_Strict):
    """vLLM engine settings for every replica of a pool."""

    enforce_eager: bool = True
    """Skip graph capture (CPU and fast start-up); set false on GPUs for speed."""
    max_num_seqs: Annotated[int, Field(ge=1, le=4096)] = 64
    """Most sequences one engine step schedules."""
    max_num_batched_tokens: Annotated[int | None, Field(ge=16)] = None
    """Token budget per engine step (vLLM's default when unset)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of shared prompt prefixes."""
    gpu_memory_utilization: Annotated[float, Field(gt=0.0, le=0.98)] = 0.15
    """Fraction of accelerator memory for the engine. On CPU vLLM reads it as a fraction of the
    NUMA node's host memory, so keep it small (0.1-0.2) there."""
    cpu_kvcache_space_gib: Annotated[int, Field(ge=1, le=1024)] = 1
    """CPU only: host memory for the KV cache in whole GiB (VLLM_CPU_KVCACHE_SPACE, which vLLM
    reads as an integer: 0.5 fails the engine's start)."""
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    """Ranks per replica for tensor parallelism. 1 in expert-parallel pools, and for now in pools
    with a KV connector (P/D, or kv_pool enabled): the connector has one KV port per engine."""
    block_size: Annotated[int | None, Field(ge=1, le=1024)] = None
    """KV cache block size in tokens (vLLM's default when unset)."""
    stream_interval_ms: Annotated[float, Field(ge=0, le=1000)] = 20.0
    """Deltas of one request arriving within this window are sent between replicas as one
    (the first token is never delayed). Cuts per-token overhead at high concurrency; 0 sends
    every engine step's delta on its own."""
    nice: Annotated[int | None, Field(ge=0, le=19)] = None
    """Linux niceness of the engine's processes. Unset: 19 on CPU engines, which share their
    cores with the HTTP front and the ingress, so a 429 or a streamed token never waits behind a
    forward pass (deployments/engine/cpu_priority.py); Ray's (15) on GPU engines."""
    extra_args: dict[str, Any] = Field(default_factory=dict)
    """Further vLLM AsyncEngineArgs fields, passed through verbatim (checked against vLLM's
    fields when the engine starts)."""


class PlacementSpec(_Strict):
    """Where a pool's replicas may run."""

    node_labels: dict[Annotated[str, Field(pattern=_LABEL_KEY)], str] = Field(default_factory=dict)
    """Ray node labels every replica's node must carry (e.g. {moe-role: decode})."""
    num_cpus: Annotated[float, Field(ge=0, le=1024)] = 1.0
    """Logical CPUs reserved per replica."""
    num_gpus: Annotated[float, Field(ge=0, le=64)] = 0.0
    """GPUs reserved per replica (must be >= engine.tensor_parallel_size on GPU manifests)."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources reserved per replica."""
    accelerator_memory_gib: Annotated[float | None, Field(gt=0, le=4096)] = None
    """Memory of one accelerator, for `plan`'s weight and KV sizing (GPU manifests). Known from
    the `accelerator-type` node label for H200, H100 and A100-80G; set it for others."""


class ExpertParallelSpec(_Strict):
    """Shard a pool's routed experts over an engine group of `size` ranks per replica.

    Each replica becomes `size` vLLM ranks (data-parallel attention, expert-parallel MoE
    layers), one per bundle of a placement group spread over the pool's nodes; every rank
    holds num_experts/size routed experts. Scaling happens in whole groups.
    """

    size: Annotated[int, Field(ge=2, le=1024)]
    """Ranks per engine group; must divide the model's number of routed experts."""
    placement_strategy: Literal["STRICT_SPREAD", "SPREAD", "PACK", "STRICT_PACK"] = "STRICT_SPREAD"
    """How the group's ranks are spread over nodes (Ray placement group strategy):
    STRICT_SPREAD puts every rank on its own node."""
    enable_eplb: bool = False
    """vLLM's expert-parallel load balancer (redundant experts, periodic rebalancing).
    GPU only: vLLM's CPU build rejects it."""
    num_redundant_experts: Annotated[int, Field(ge=0, le=4096)] = 0
    """Extra expert replicas EPLB may place (needs enable_eplb)."""
    rank_failure_timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    """After a rank dies, in-flight requests of its group fail (retriable) within this time."""


class PoolSpec(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,40}$")]
    """Pool name, unique in the manifest: lower case letters, digits and dashes."""
    role: PoolRole = PoolRole.colocated
    """colocated (prefill and decode in one engine), prefill or decode."""
    replicas: Annotated[int, Field(ge=1, le=10_000)] = 1
    """Engine replicas in the pool (with autoscaling: the number it starts with)."""
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the pool's engine processes."""
    expert_parallel: ExpertParallelSpec | None = None
    """Make every replica an expert-parallel engine group (see ExpertParallelSpec); placement
    then applies per rank (num_cpus, num_gpus and node_labels of each rank's bundle)."""
    autoscaling: PoolAutoscalingSpec | None = None
    """Let the autoscaler size this pool between min_replicas and max_replicas (groups, for
    expert-parallel pools). Give it to every pool or to none."""
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    """Which replica serves each request: serve_default, round_robin, least_loaded or prefix."""

    @property
    def ranks_per_replica(self) -> int:
        return self.expert_parallel.size if self.expert_parallel else 1


class SLOSpec(_Strict):
    ttft_ms: Annotated[float, Field(gt=0)] = 2000.0
    """Target time to first token, p90, in milliseconds."""
    itl_ms: Annotated[float, Field(gt=0)] = 200.0
    """Target inter-token latency, p90, in milliseconds."""


class ObservabilitySpec(_Strict):
    """Metrics and the local Prometheus that `moe-serve up` starts next to the cluster."""

    metrics: bool = True
    """Export moe-serve's and vLLM's Prometheus metrics through Ray's metrics pipeline."""
    prometheus_port: Annotated[int, Field(ge=1, le=65535)] = 9090
    """Port of the local Prometheus (`moe-serve up` only)."""
    scrape_interval_s: Annotated[float, Field(ge=1, le=300)] = 5.0
    """How often Prometheus scrapes Ray's metrics endpoints."""


class LocalNodeSpec(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,40}$")]
    """Node name, for humans and plan output."""
    num_cpus: Annotated[int, Field(ge=1, le=1024)] = 2
    """Logical CPUs the node advertises to Ray (may exceed physical cores on one machine)."""
    labels: dict[Annotated[str, Field(pattern=_LABEL_KEY)], str] = Field(default_factory=dict)
    """Ray node labels, matched by pools' placement.node_labels."""


class LocalClusterSpec(_Strict):
    """The cluster `moe-serve up` starts on this machine (ignored by `moe-serve deploy`)."""

    nodes: Annotated[list[LocalNodeSpec], Field(min_length=1)]
    """Ray nodes to start; the first is the head (runs the Serve controller and HTTP proxy)."""


class Manifest(_Strict):
    name: Annotated[str, Field(pattern=r"^[a-z][a-z0-9-]{0,40}$")]
    """Serve application name."""
    accelerator: Accelerator = Accelerator.cpu
    """cpu (vllm-cpu build) or gpu (vllm)."""
    model: ModelSpec
    """The model to serve: name, path (a checkpoint directory or builtin://NAME), max_model_len, dtype."""
    pools: Annotated[list[PoolSpec], Field(min_length=1)]
    """Engine pools, each with name, role, replicas, placement and engine settings."""
    slo: SLOSpec = Field(default_factory=SLOSpec)
    http: HTTPSpec = Field(default_factory=HTTPSpec)
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    kv_pool: KVPoolSpec = Field(default_factory=KVPoolSpec)
    """The cluster-wide KV cache pool (off unless enabled)."""
    admission: AdmissionSpec = Field(default_factory=AdmissionSpec)
    """Bounded queues: past them the ingress answers 429 with Retry-After."""
    request_timeouts: RequestTimeoutsSpec = Field(default_factory=RequestTimeoutsSpec)
    """Bounds on the prefill, first-token and inter-token waits (504 past them; cluster/manifest_timeouts.py)."""
    observability: ObservabilitySpec = Field(default_factory=ObservabilitySpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    """Settings of the coordinated autoscaler (used when the pools have autoscaling bounds)."""
    local_cluster: LocalClusterSpec | None = None
    kubernetes: KubernetesSpec = Field(default_factory=KubernetesSpec)
    """How `moe-serve build --kuberay` lays it out as a KubeRay RayService (cluster/manifest_kubernetes.py)."""

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        problems: list[ManifestIssue] = []
        names = [pool.name for pool in self.pools]
        for index, name in enumerate(names):
            if names.index(name) != index:
                problems.append(ManifestIssue(
                    f"pools[{index}].name", name, "duplicate pool name", "give every pool its own name"))
        roles = sorted(pool.role.value for pool in self.pools)
        if roles not in (["colocated"], ["decode", "prefill"]):
            problems.append(ManifestIssue(
                "pools[].role", roles, "unsupported pool layout",
                "declare one colocated pool, or one prefill pool and one decode pool"))
        elif self.disaggregated:
            if self.kv_transfer.transfer_timeout_s >= self.kv_transfer.lease_s:
                problems.append(ManifestIssue(
                    "kv_transfer.transfer_timeout_s", self.kv_transfer.transfer_timeout_s,
                    f"not shorter than lease_s={self.kv_transfer.lease_s:g}: no pull could ever start",
                    "make lease_s several times transfer_timeout_s (e.g. 30 and 5)"))
            prefill, decode = self.pool_with_role(PoolRole.prefill), self.pool_with_role(PoolRole.decode)
            if self.kv_transfer.local_prefill_hit_fraction is not None and not (
                    decode.routing.policy == "prefix" and decode.engine.enable_prefix_caching):
                problems.append(ManifestIssue(
                    "kv_transfer.local_prefill_hit_fraction", self.kv_transfer.local_prefill_hit_fraction,
                    "needs to know what the decode replicas' prefix caches hold",
                    f"set pools[{self.pools.index(decode)}].routing.policy: prefix and "
                    "engine.enable_prefix_caching: true on the decode pool, or remove it"))
            if prefill.engine.block_size != decode.engine.block_size:
                problems.append(ManifestIssue(
                    "pools[].engine.block_size", [prefill.engine.block_size, decode.engine.block_size],
                    "prefill and decode must use one KV block size (blocks are copied as they are)",
                    "set the same engine.block_size on both pools"))
        for index, pool in enumerate(self.pools):
            if self.accelerator is Accelerator.gpu and pool.placement.num_gpus < pool.engine.tensor_parallel_size:
                problems.append(ManifestIssue(
                    f"pools[{index}].placement.num_gpus", pool.placement.num_gpus,
                    f"fewer GPUs than engine.tensor_parallel_size={pool.engine.tensor_parallel_size}",
                    "reserve at least one GPU per tensor-parallel rank"))
            if self.accelerator is Accelerator.cpu and pool.placement.num_gpus > 0:
                problems.append(ManifestIssue(
                    f"pools[{index}].placement.num_gpus", pool.placement.num_gpus,
                    "GPUs requested on a cpu manifest", "set accelerator: gpu or num_gpus: 0"))
            problems.extend(_expert_parallel_issues(self, index, pool))
            if self.local_cluster and pool.placement.node_labels and not any(
                pool.placement.node_labels.items() <= node.labels.items() for node in self.local_cluster.nodes
            ):
                problems.append(ManifestIssue(
                    f"pools[{index}].placement.node_labels", pool.placement.node_labels,
                    "no node of local_cluster carries these labels",
                    "add the labels to a node in local_cluster.nodes or change the selector"))
        if self.kv_pool.enabled and self.kv_pool.protocol == "rdma" and self.accelerator is Accelerator.cpu:
            problems.append(ManifestIssue(
                "kv_pool.protocol", "rdma", "RDMA on a cpu manifest", "use protocol: tcp on CPU machines"))
        if self.kv_transfer.protocol == "rdma" and self.kv_transfer.backend != "mooncake":
            problems.append(ManifestIssue(
                "kv_transfer.protocol", "rdma", f"backend {self.kv_transfer.backend!r} speaks tcp only",
                "set kv_transfer.backend: mooncake for RDMA, or protocol: tcp"))
        if self.kv_transfer.protocol == "rdma" and self.accelerator is Accelerator.cpu:
            problems.append(ManifestIssue(
                "kv_transfer.protocol", "rdma", "RDMA on a cpu manifest", "use protocol: tcp on CPU machines"))
        problems.extend(kv_connector_issues(self))
        problems.extend(autoscaling_issues(self))
        problems.extend(timeout_issues(self))
        problems.extend(rdma_issues(self))
        if self.local_cluster:
            node_names = [node.name for node in self.local_cluster.nodes]
            if len(set(node_names)) != len(node_names):
                problems.append(ManifestIssue(
                    "local_cluster.nodes[].name", node_names, "duplicate node names", "name every node uniquely"))
        if problems:
            raise _ConsistencyError(problems)
        return self

    @property
    def autoscaled(self) -> bool:
        return any(pool.autoscaling is not None for pool in self.pools)

    @property
    def disaggregated(self) -> bool:
        return any(pool.role is PoolRole.prefill for pool in self.pools)

    def pool_with_role(self, role: PoolRole) -> PoolSpec:
        return next(pool for pool in self.pools if pool.role is role)

    def pool(self, name: str) -> PoolSpec:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(name)


def _expert_parallel_issues(manifest: "Manifest", index: int, pool: PoolSpec) -> list[ManifestIssue]:
    ep = pool.expert_parallel
    if ep is None:
        return []
    where = f"pools[{index}].expert_parallel"
    problems: list[ManifestIssue] = []
    if ep.enable_eplb and manifest.accelerator is Accelerator.cpu:
        problems.append(ManifestIssue(
            f"{where}.enable_eplb", True, "vLLM's CPU build rejects expert load balancing (EPLB)",
            "set enable_eplb: false on cpu manifests (per-expert load is still exported as metrics)"))
    if ep.num_redundant_experts and not ep.enable_eplb:
        problems.append(ManifestIssue(
            f"{where}.num_redundant_experts", ep.num_redundant_experts, "redundant experts need EPLB",
            "set enable_eplb: true (GPU) or num_redundant_experts: 0"))
    if pool.engine.tensor_parallel_size != 1:
        problems.append(ManifestIssue(
            f"pools[{index}].engine.tensor_parallel_size", pool.engine.tensor_parallel_size,
            "expert-parallel groups here use data-parallel attention with one device per rank",
            "set tensor_parallel_size: 1 (scale with expert_parallel.size instead)"))
    if manifest.local_cluster and ep.placement_strategy == "STRICT_SPREAD":
        fitting = [node for node in manifest.local_cluster.nodes
                   if pool.placement.node_labels.items() <= node.labels.items()]
        if len(fitting) < ep.size:
            problems.append(ManifestIssue(
                f"{where}.size", ep.size,
                f"STRICT_SPREAD needs {ep.size} nodes carrying {pool.placement.node_labels or 'any labels'}, "
                f"local_cluster has {len(fitting)}",
                "add nodes with those labels to local_cluster.nodes, or use placement_strategy: PACK"))
    return problems


class _ConsistencyError(ValueError):
    def __init__(self, issues: list[ManifestIssue]):
        self.issues = issues
        super().__init__("; ".join(map(str, issues)))


# Loading (YAML -> Manifest) and turning pydantic's errors into ManifestIssues is its own job;
# re-exported here so that callers keep importing everything manifest-related from one place.
from cluster.manifest_loading import load_manifest, parse_manifest  # noqa: E402  (needs Manifest above)

__all__ = ["Accelerator", "ExpertParallelSpec", "Manifest", "ManifestError", "PoolRole", "PoolSpec",
           "load_manifest", "parse_manifest"]
