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
    num_experts: int | None = None  # routed experts per MoE layer
    expert_weight_bytes: int = 0  # the routed experts' share of weight_bytes (split by EP)


@dataclass(frozen=True)
class ReplicaPlacement:
    pool: str
    replica_index: int
    node: str  # a local node name, or the label selector when no cluster is declared
    num_cpus: float
    num_gpus: float
    rank: int | None = None  # expert-parallel pools: the rank within the replica's group
    experts: tuple[int, int] | None = None  # first and last routed expert this rank holds
    weight_bytes: int | None = None  # weights this rank (or replica) loads


@dataclass(frozen=True)
class PoolPlan:
    name: str
    role: str
    replicas: list[ReplicaPlacement]
    kv_cache_bytes_per_replica: int | None  # per rank in expert-parallel pools
    kv_cache_tokens_per_replica: int | None
    expert_parallel: str | None = None  # one line: group size, strategy, EPLB


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
    autoscaling: str | None = None  # one line: bounds per pool and how the controller decides


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
        ranks = pool.ranks_per_replica
        for index in range(pool.replicas):
            for rank in range(ranks):
                if nodes:
                    # Spread strategies put a group's ranks on distinct nodes; packed ones fill a node.
                    spread = pool.expert_parallel is None or "SPREAD" in pool.expert_parallel.placement_strategy
                    node = matching[(index + rank) % len(matching)] if spread else matching[index % len(matching)]
                    reserved[node] += pool.placement.num_cpus
                else:
                    node = _selector(pool)
                placements.append(ReplicaPlacement(
                    pool.name, index, node, pool.placement.num_cpus, pool.placement.num_gpus,
                    rank=rank if pool.expert_parallel else None,
                    experts=_expert_range(facts, rank, ranks) if pool.expert_parallel else None,
                    weight_bytes=_weights_per_rank(facts, ranks)))
        kv_bytes, kv_tokens = _kv_capacity(manifest, pool, facts)
        pools.append(PoolPlan(pool.name, pool.role.value, placements, kv_bytes, kv_tokens,
                              _expert_parallel_line(manifest, pool, facts, warnings)))

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
    return Plan(manifest.name, manifest.model.name, url, ingress_node, pools, reserved, warnings, facts, kv,
                _autoscaling_line(manifest, warnings))


def _autoscaling_line(manifest: Manifest, warnings: list[str]) -> str | None:
    if not manifest.autoscaled:
        return None
    spec = manifest.autoscaling
    nodes = manifest.local_cluster.nodes if manifest.local_cluster else []
    bounds = []
    for pool in manifest.pools:
        unit = " groups" if pool.expert_parallel else ""
        bounds.append(f"{pool.name} {pool.autoscaling.min_replicas}..{pool.autoscaling.max_replicas}{unit}")
        matching = [n for n in nodes if pool.placement.node_labels.items() <= n.labels.items()]
        need = pool.autoscaling.max_replicas * pool.ranks_per_replica * pool.placement.num_cpus
        have = sum(n.num_cpus for n in matching)
        if nodes and need > have:
            warnings.append(f"pool {pool.name} at max_replicas needs {need:g} CPUs on its nodes, which advertise "
                            f"{have:g}: replicas beyond that stay pending; lower max_replicas or add nodes")
    source = spec.prometheus_url or f"the local Prometheus (port {manifest.observability.prometheus_port})"
    budget = f", budget {spec.budget_units:g} {'GPUs' if manifest.accelerator.value == 'gpu' else 'CPUs'}" \
        if spec.budget_units else ""
    return (f"{', '.join(bounds)}; decides every {spec.decision_interval_s:g}s from {source}; cooldown out "
            f"{spec.scale_out_cooldown_s:g}s / in {spec.scale_in_cooldown_s:g}s{budget}")


def _expert_range(facts: ModelFacts | None, rank: int, size: int) -> tuple[int, int] | None:
    """vLLM's linear expert placement: rank r holds a contiguous block (remainder to the first ranks)."""
    if facts is None or not facts.num_experts:
        return None
    base, extra = divmod(facts.num_experts, size)
    first = rank * base + min(rank, extra)
    return first, first + base + (1 if rank < extra else 0) - 1


def _weights_per_rank(facts: ModelFacts | None, ranks: int) -> int | None:
    if facts is None:
        return None
    dense = facts.weight_bytes - facts.expert_weight_bytes
    return dense + -(-facts.expert_weight_bytes // ranks)


def _expert_parallel_line(manifest: Manifest, pool: PoolSpec, facts: ModelFacts | None,
                          warnings: list[str]) -> str | None:
    ep = pool.expert_parallel
    if ep is None:
        return None
    if facts and facts.num_experts and facts.num_experts % ep.size:
        warnings.append(f"pool {pool.name}: {facts.num_experts} routed experts do not split evenly over "
                        f"{ep.size} ranks; the first ranks hold one more (uneven load)")
    if manifest.accelerator.value == "cpu":
        eplb = "EPLB unavailable (vLLM's CPU build rejects it; per-expert load is still exported)"
    else:
        eplb = (f"EPLB on, {ep.num_redundant_experts} redundant experts" if ep.enable_eplb else "EPLB off")
    return (f"{ep.size} ranks per replica (data-parallel attention, expert-parallel MoE), "
            f"{ep.placement_strategy}, {eplb}")


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
    for pool in plan.pools:
        if pool.expert_parallel:
            lines.append(f"experts      pool {pool.name}: {pool.expert_parallel}")
    if plan.autoscaling:
        lines.append(f"autoscaling  {plan.autoscaling}")
    lines.append("")
    lines.append(f"{'pool':<12}{'role':<11}{'replica':<9}{'rank':<6}{'experts':<10}{'node':<30}"
                 f"{'cpus':>6}{'gpus':>6}  {'weights':<11}kv cache")
    for pool in plan.pools:
        kv = "auto (GPU memory)" if pool.kv_cache_bytes_per_replica is None else _gib(pool.kv_cache_bytes_per_replica)
        if pool.kv_cache_tokens_per_replica:
            kv += f" = {pool.kv_cache_tokens_per_replica:,} tokens"
        for rep in pool.replicas:
            rank = "-" if rep.rank is None else str(rep.rank)
            if rep.experts:
                experts = f"{rep.experts[0]}-{rep.experts[1]}"
            else:
                experts = "1/" + str(len({r.rank for r in pool.replicas})) if rep.rank is not None else "all"
            weights = "?" if rep.weight_bytes is None else _gib(rep.weight_bytes)
            lines.append(f"{pool.name:<12}{pool.role:<11}{rep.replica_index:<9}{rank:<6}{experts:<10}{rep.node:<30}"
                         f"{rep.num_cpus:>6g}{rep.num_gpus:>6g}  {weights:<11}{kv}")
    if plan.node_cpu_reserved:
        lines.append("")
        lines.append("cpus reserved per node: " + ", ".join(f"{k}={v:g}" for k, v in plan.node_cpu_reserved.items()))
    for warning in plan.warnings:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= (1 << 28) else f"{n / (1 << 20):.1f} MiB"
