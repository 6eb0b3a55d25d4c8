"""What a manifest would run where: pure placement math, no Ray, no I/O.

Placement rule (mirrors what Ray does at deploy time, so `plan` predicts it): a replica may
run on a node whose labels include all of the pool's placement.node_labels. On a declared
local cluster, replicas are spread round-robin over matching nodes, and a node is overfull
when the logical CPUs reserved on it exceed what it advertises. Without a declared cluster
(a GPU manifest deployed onto an existing cluster), the plan states the selector instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.manifest import Manifest, PoolSpec

INGRESS_NUM_CPUS = 0.25  # tokenization and validation only; leaves the cores to the engines


@dataclass(frozen=True)
class ModelFacts:
    """What plan needs to know of a checkpoint, read by cluster.model_facts."""

    weight_bytes: int
    num_layers: int
    kv_bytes_per_token: int  # K and V, all layers, at the manifest dtype
    num_experts: int | None = None


@dataclass(frozen=True)
class ReplicaPlacement:
    pool: str
    replica_index: int
    node: str  # a local node name, or the label selector when no cluster is declared
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class PoolPlan:
    name: str
    role: str
    replicas: list[ReplicaPlacement]
    kv_cache_bytes_per_replica: int | None
    kv_cache_tokens_per_replica: int | None


@dataclass(frozen=True)
class Plan:
    app_name: str
    model_name: str
    endpoint_url: str
    ingress_node: str
    pools: list[PoolPlan]
    node_cpu_reserved: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    model_facts: ModelFacts | None = None
    kv_transfer: str | None = None  # one line describing the transfer path, when disaggregated


def make_plan(manifest: Manifest, facts: ModelFacts | None = None) -> Plan:
    warnings: list[str] = []
    nodes = manifest.local_cluster.nodes if manifest.local_cluster else []
    reserved = {node.name: 0.0 for node in nodes}
    ingress_node = nodes[0].name if nodes else "any node (Serve places it)"
    if nodes:
        reserved[ingress_node] += INGRESS_NUM_CPUS * manifest.http.ingress_replicas

    pools = []
    for pool in manifest.pools:
        matching = [n.name for n in nodes if pool.placement.node_labels.items() <= n.labels.items()]
        placements = []
        for index in range(pool.replicas):
            if nodes:
                node = matching[index % len(matching)]
                reserved[node] += pool.placement.num_cpus
            else:
                node = _selector(pool)
            placements.append(ReplicaPlacement(pool.name, index, node, pool.placement.num_cpus, pool.placement.num_gpus))
        kv_bytes, kv_tokens = _kv_capacity(manifest, pool, facts)
        pools.append(PoolPlan(pool.name, pool.role.value, placements, kv_bytes, kv_tokens))

    for node in nodes:
        if reserved[node.name] > node.num_cpus:
            warnings.append(
                f"node {node.name} reserves {reserved[node.name]:g} CPUs but advertises {node.num_cpus}: "
                "some replicas will stay pending; raise num_cpus or spread the pool")
    url = f"http://{manifest.http.host}:{manifest.http.port}{manifest.http.route_prefix.rstrip('/')}"
    kv = None
    if manifest.disaggregated:
        t = manifest.kv_transfer
        kv = (f"decode pulls prompt KV from prefill over {t.backend}; lease {t.lease_s:g}s, "
              f"timeout {t.transfer_timeout_s:g}s, on failure: {t.failure_policy}")
    return Plan(manifest.name, manifest.model.name, url, ingress_node, pools, reserved, warnings, facts, kv)


def _selector(pool: PoolSpec) -> str:
    labels = pool.placement.node_labels
    return "nodes with " + ", ".join(f"{k}={v}" for k, v in labels.items()) if labels else "any node"


def _kv_capacity(manifest: Manifest, pool: PoolSpec, facts: ModelFacts | None) -> tuple[int | None, int | None]:
    if manifest.accelerator.value != "cpu":
        return None, None  # vLLM sizes GPU KV cache from free memory at start-up
    kv_bytes = int(pool.engine.cpu_kvcache_space_gib * (1 << 30))
    if facts is None or facts.kv_bytes_per_token <= 0:
        return kv_bytes, None
    return kv_bytes, kv_bytes // facts.kv_bytes_per_token


def render_plan(plan: Plan) -> str:
    lines = [f"application {plan.app_name}: model {plan.model_name}", f"endpoint     {plan.endpoint_url}/v1"]
    if plan.model_facts:
        f = plan.model_facts
        experts = f", {f.num_experts} routed experts/layer" if f.num_experts else ""
        lines.append(f"checkpoint   {_gib(f.weight_bytes)} weights, {f.num_layers} layers{experts}, "
                     f"{f.kv_bytes_per_token} KV bytes/token")
    else:
        lines.append("checkpoint   not readable here (sizes unknown)")
    lines.append(f"ingress      on {plan.ingress_node}")
    if plan.kv_transfer:
        lines.append(f"kv transfer  {plan.kv_transfer}")
    lines.append("")
    lines.append(f"{'pool':<12}{'role':<11}{'replica':<9}{'node':<34}{'cpus':>6}{'gpus':>6}  kv cache")
    for pool in plan.pools:
        kv = "auto (GPU memory)" if pool.kv_cache_bytes_per_replica is None else _gib(pool.kv_cache_bytes_per_replica)
        if pool.kv_cache_tokens_per_replica:
            kv += f" = {pool.kv_cache_tokens_per_replica:,} tokens"
        for rep in pool.replicas:
            lines.append(f"{pool.name:<12}{pool.role:<11}{rep.replica_index:<9}{rep.node:<34}"
                         f"{rep.num_cpus:>6g}{rep.num_gpus:>6g}  {kv}")
    if plan.node_cpu_reserved:
        lines.append("")
        lines.append("cpus reserved per node: " + ", ".join(f"{k}={v:g}" for k, v in plan.node_cpu_reserved.items()))
    for warning in plan.warnings:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= (1 << 28) else f"{n / (1 << 20):.1f} MiB"
