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
from cluster.plan_memory import (
    GIB,
    RankMemory,
    accelerator_memory_gib,
    kv_bytes_per_token_cached_as,
    rank_memory,
    smallest_fitting_split,
)

INGRESS_NUM_CPUS = 0.25  # tokenization and validation only; leaves the cores to the engines


@dataclass(frozen=True)
class ModelFacts:
    """What plan needs to know of a checkpoint, read by cluster.model_facts."""

    weight_bytes: int
    num_layers: int
    kv_bytes_per_token: int  # all layers, one rank without TP, at the manifest dtype (MLA: the latent)
    num_experts: int | None = None  # routed experts per MoE layer
    expert_weight_bytes: int = 0  # the routed experts' share of weight_bytes (split by EP)
    attention: str = ""  # e.g. "MLA (576-value latent)", "GQA (8 KV heads x 128)"
    mla: bool = False
    kv_heads: int = 0
    kv_element_bytes: int = 0
    source: str = ""  # where the facts came from (checkpoint, shipped config)

    def kv_bytes_per_token_cached_as(self, kv_cache_dtype: str) -> int | None:
        """All layers, one rank without TP, at the engine's kv_cache_dtype (None: not sized)."""
        return kv_bytes_per_token_cached_as(kv_cache_dtype, model_bytes=self.kv_bytes_per_token,
                                            value_bytes=self.kv_element_bytes, num_layers=self.num_layers, mla=self.mla)

    def kv_bytes_per_token_on_rank(self, tensor_parallel: int, kv_cache_dtype: str = "auto") -> int:
        """MLA's latent is replicated over TP ranks; GQA's KV heads are split (>= 1 per rank).
        A kv_cache_dtype plan cannot size counts at the model's dtype (make_plan warns)."""
        full = self.kv_bytes_per_token_cached_as(kv_cache_dtype) or self.kv_bytes_per_token
        if self.mla or self.kv_heads <= 0 or tensor_parallel <= 1:
            return full
        return full * max(1, self.kv_heads // tensor_parallel) // self.kv_heads


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
    rank_memory: RankMemory | None = None  # per rank (every rank of a pool is alike)
    kv_cache_dtype: str = "auto"  # the engine's (engine.extra_args.kv_cache_dtype)


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
    errors: list[str] = field(default_factory=list)  # the manifest cannot run as written (e.g. weights do not fit)
    kv_pool: str | None = None  # one line: the KV pool's capacity in bytes and tokens of the model


def make_plan(manifest: Manifest, facts: ModelFacts | None = None) -> Plan:
    warnings: list[str] = []
    nodes = manifest.local_cluster.nodes if manifest.local_cluster else []
    reserved = {node.name: 0.0 for node in nodes}
    ingress_node = nodes[0].name if nodes else "any node (Serve places it)"
    if nodes:
        reserved[ingress_node] += INGRESS_NUM_CPUS * manifest.http.ingress_replicas

    pools = []
    errors: list[str] = []
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
                    experts=_expert_range(_physical_experts(facts, pool), rank, ranks) if pool.expert_parallel else None,
                    weight_bytes=_weights_per_rank(facts, ranks, pool.engine.tensor_parallel_size, pool)))
        memory = _rank_memory(manifest, pool, facts)
        errors.extend(_fit_issues(manifest, pool, facts, memory, warnings))
        kv_bytes, kv_tokens = _kv_capacity(manifest, pool, facts, memory)
        dtype = _kv_cache_dtype(pool)
        if facts is not None and facts.kv_bytes_per_token_cached_as(dtype) is None:
            warnings.append(f"pool {pool.name}: plan cannot size kv_cache_dtype {dtype!r}; its KV is counted at the "
                            f"model's dtype (known: auto, {', '.join(_known_kv_dtypes(facts))})")
        pools.append(PoolPlan(pool.name, pool.role.value, placements, kv_bytes, kv_tokens,
                              _expert_parallel_line(manifest, pool, facts, warnings, errors), memory, dtype))

    for node in nodes:
        if reserved[node.name] > node.num_cpus:
            warnings.append(
                f"node {node.name} reserves {reserved[node.name]:g} CPUs but advertises {node.num_cpus}: "
                "some replicas will stay pending; raise num_cpus or spread the pool")
    errors.extend(_staging_issues(manifest, facts))
    url = f"http://{manifest.http.host}:{manifest.http.port}{manifest.http.route_prefix.rstrip('/')}"
    kv = None
    if manifest.disaggregated:
        t = manifest.kv_transfer
        kv = (f"decode pulls prompt KV from prefill over {t.backend}; lease {t.lease_s:g}s, "
              f"timeout {t.transfer_timeout_s:g}s, both + the KV's bytes at {t.min_transfer_mib_s:g} MiB/s"
              f"{_longest_prompt_transfer(manifest, facts)}, on failure: {t.failure_policy}")
    return Plan(manifest.name, manifest.model.name, url, ingress_node, pools, reserved, warnings, facts, kv,
                _autoscaling_line(manifest, warnings), errors, _kv_pool_line(manifest, facts))


def _staging_issues(manifest: Manifest, facts: ModelFacts | None) -> list[str]:
    """Mooncake moves a GPU cache's blocks through one registered staging arena per worker, and a
    pull is staged whole: a prompt whose KV outgrows the arena can never be pulled (decode then
    recomputes it, every time)."""
    t = manifest.kv_transfer
    if not manifest.disaggregated or t.backend != "mooncake" or manifest.accelerator.value != "gpu" \
            or facts is None or facts.kv_bytes_per_token <= 0:
        return []
    prefill = next(pool for pool in manifest.pools if pool.role.value == "prefill")
    per_token = facts.kv_bytes_per_token_on_rank(prefill.engine.tensor_parallel_size, _kv_cache_dtype(prefill))
    need_mib = -(-manifest.model.max_model_len * per_token // (1 << 20))
    if need_mib <= t.staging_mib:
        return []
    return [f"kv_transfer.staging_mib={t.staging_mib}: a {manifest.model.max_model_len:,}-token prompt's KV is "
            f"{need_mib:,} MiB per rank, more than one staging arena holds, so decode could never pull it (it would "
            f"recompute every such prompt); raise staging_mib to at least {need_mib}, or lower model.max_model_len"]


def _longest_prompt_transfer(manifest: Manifest, facts: ModelFacts | None) -> str:
    """What a max_model_len prompt's pull adds to both bounds (empty when the size is unknown)."""
    if facts is None or facts.kv_bytes_per_token <= 0:
        return ""
    prefill = next(pool for pool in manifest.pools if pool.role.value == "prefill")
    tp = prefill.engine.tensor_parallel_size
    nbytes = manifest.model.max_model_len * facts.kv_bytes_per_token_on_rank(tp, _kv_cache_dtype(prefill))
    return (f" (a {manifest.model.max_model_len:,}-token prompt: {nbytes / (1 << 20):,.0f} MiB per rank, "
            f"+{nbytes / (manifest.kv_transfer.min_transfer_mib_s * (1 << 20)):.1f}s)")


def kv_pool_capacity_tokens(manifest: Manifest, facts: ModelFacts | None) -> int:
    """Tokens of the model the KV pool holds at the manifest's replica counts (0: no pool, or the
    model's KV size per token is unknown)."""
    spec = manifest.kv_pool
    per_token = _kv_pool_bytes_per_token(manifest, facts)
    if not spec.enabled or per_token <= 0:
        return 0
    return _kv_pool_bytes(manifest, lambda pool: pool.replicas) // per_token


def _kv_pool_bytes_per_token(manifest: Manifest, facts: ModelFacts | None) -> int:
    """A token's KV as the pool stores it: whole blocks of the engines' caches, at their
    kv_cache_dtype (the largest, should pools differ). 0: unknown."""
    if facts is None or facts.kv_bytes_per_token <= 0:
        return 0
    return max(facts.kv_bytes_per_token_on_rank(1, _kv_cache_dtype(pool)) for pool in manifest.pools)


def _kv_pool_bytes(manifest: Manifest, replicas_of) -> int:
    """Every engine (rank) contributes its role's segment (kv_pool.segment_mib_for)."""
    return sum(replicas_of(pool) * pool.ranks_per_replica * (manifest.kv_pool.segment_mib_for(pool.role) << 20)
               for pool in manifest.pools)


def _kv_pool_line(manifest: Manifest, facts: ModelFacts | None) -> str | None:
    """Capacity of the KV pool: every engine (rank) contributes its segment on its node; with
    autoscaling the pool grows and shrinks with the engines, so the range is shown."""
    spec = manifest.kv_pool
    if not spec.enabled:
        return None
    now = _kv_pool_bytes(manifest, lambda pool: pool.replicas)
    most = _kv_pool_bytes(manifest, lambda pool: pool.autoscaling.max_replicas if pool.autoscaling else pool.replicas)
    per_token = _kv_pool_bytes_per_token(manifest, facts)

    def capacity(total: int) -> str:
        return f"{_gib(total)} = {total // per_token:,} tokens" if per_token > 0 else _gib(total)
    size = capacity(now) if now == most else f"{capacity(now)} (up to {capacity(most)} at max replicas)"
    counts = [(pool.name, pool.replicas * pool.ranks_per_replica, spec.segment_mib_for(pool.role))
              for pool in manifest.pools]
    if len({mib for _, _, mib in counts}) == 1:
        engines = f"{sum(count for _, count, _ in counts)} engine(s) x {spec.segment_mib} MiB"
    else:
        engines = " + ".join(f"{count} {name} engine(s) x {mib} MiB" for name, count, mib in counts)
    disk = ""
    if spec.disk is not None:
        engines_now = sum(pool.replicas * pool.ranks_per_replica for pool in manifest.pools
                          if spec.segment_mib_for(pool.role) > 0)
        disk_bytes = int(engines_now * spec.disk.capacity_gib * (1 << 30))
        disk = (f"; disk tier under it: {engines_now} engine(s) x {spec.disk.capacity_gib:g} GiB at "
                f"{spec.disk.path} = {capacity(disk_bytes)}")
    sessions = ""
    if spec.sessions is not None:
        pinned = int(now * spec.sessions.max_pinned_share)
        sessions = (f"; sessions (X-Session-Id) keep their history in DRAM for {spec.sessions.idle_s:g} s after "
                    f"their last turn, pins at most {capacity(pinned)}")
    return (f"{spec.backend} store over {spec.protocol}, master on the head node; {engines} = {size}{disk}"
            f"{sessions}; every engine loads prefixes from it and stores what it computed")


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


def _kv_cache_dtype(pool: PoolSpec) -> str:
    return str(pool.engine.extra_args.get("kv_cache_dtype") or "auto")


def _known_kv_dtypes(facts: ModelFacts) -> list[str]:
    from cluster.plan_memory import KV_CACHE_VALUE_BYTES, MLA_PACKED_BYTES_PER_LAYER

    return list(KV_CACHE_VALUE_BYTES) + (list(MLA_PACKED_BYTES_PER_LAYER) if facts.mla else [])


def _expert_range(physical_experts: int | None, rank: int, size: int) -> tuple[int, int] | None:
    """vLLM's linear expert placement: rank r holds a contiguous block of the physical expert
    slots (routed experts, then EPLB's redundant copies), the remainder to the first ranks."""
    if not physical_experts:
        return None
    base, extra = divmod(physical_experts, size)
    first = rank * base + min(rank, extra)
    return first, first + base + (1 if rank < extra else 0) - 1


def _weights_per_rank(facts: ModelFacts | None, ranks: int, tp: int = 1, pool: PoolSpec | None = None) -> int | None:
    if facts is None:
        return None
    from cluster.plan_memory import weights_per_rank

    experts = _physical_expert_bytes(facts, pool)
    return weights_per_rank(facts.weight_bytes - facts.expert_weight_bytes + experts, experts, ranks, tp)


def _physical_experts(facts: ModelFacts | None, pool: PoolSpec | None) -> int | None:
    """Expert slots per MoE layer over a pool's group: the routed experts plus EPLB's redundant copies."""
    if facts is None or not facts.num_experts:
        return None
    ep = pool.expert_parallel if pool is not None else None
    return facts.num_experts + (ep.num_redundant_experts if ep and ep.enable_eplb else 0)


def _physical_expert_bytes(facts: ModelFacts, pool: PoolSpec | None) -> int:
    """EPLB's redundant experts are extra copies: (experts + redundant) / experts of the bytes."""
    physical = _physical_experts(facts, pool)
    if not physical or physical == facts.num_experts:
        return facts.expert_weight_bytes
    return facts.expert_weight_bytes * physical // facts.num_experts


def _rank_memory(manifest: Manifest, pool: PoolSpec, facts: ModelFacts | None) -> RankMemory | None:
    if facts is None:
        return None
    tp = pool.engine.tensor_parallel_size
    experts = _physical_expert_bytes(facts, pool)
    return rank_memory(
        weight_bytes=facts.weight_bytes - facts.expert_weight_bytes + experts, expert_bytes=experts,
        kv_bytes_per_token=facts.kv_bytes_per_token_on_rank(tp, _kv_cache_dtype(pool)), ep_size=pool.ranks_per_replica,
        tp_size=tp,
        gpu=manifest.accelerator.value == "gpu",
        memory_gib=accelerator_memory_gib(pool.placement.node_labels, pool.placement.accelerator_memory_gib),
        utilization=pool.engine.gpu_memory_utilization, cpu_kv_gib=pool.engine.cpu_kvcache_space_gib)


def _fit_issues(manifest: Manifest, pool: PoolSpec, facts: ModelFacts | None, memory: RankMemory | None,
                warnings: list[str]) -> list[str]:
    if facts is None or memory is None:
        return []
    if manifest.accelerator.value == "gpu" and memory.usable_bytes is None:
        warnings.append(f"pool {pool.name}: accelerator memory unknown (no {_known_label()} node label); set "
                        "placement.accelerator_memory_gib to size the KV cache and check that the weights fit")
        return []
    if not memory.fits:
        ep, tp = pool.ranks_per_replica, pool.engine.tensor_parallel_size
        experts, physical = _physical_expert_bytes(facts, pool), _physical_experts(facts, pool)
        split = smallest_fitting_split(facts.weight_bytes - facts.expert_weight_bytes + experts, experts, physical,
                                       memory.usable_bytes, ep, tp)
        slots = "experts" if physical == facts.num_experts else "expert slots (EPLB's redundant ones included)"
        fix = (f"set expert_parallel.size: {split} (the smallest that divides {physical} {slots} and fits)"
               if split else "add tensor-parallel ranks")
        return [f"pool {pool.name}: each rank loads {_gib(memory.weight_bytes)} of weights but has "
                f"{_gib(memory.device_memory_bytes)} x gpu_memory_utilization {pool.engine.gpu_memory_utilization:g} "
                f"= {_gib(memory.usable_bytes)}; {fix}, quantize (model.quantization: fp8), or use larger devices"]
    if memory.kv_tokens and memory.kv_tokens < manifest.model.max_model_len:
        warnings.append(f"pool {pool.name}: a rank holds at most {memory.kv_tokens:,} tokens of KV, fewer than "
                        f"max_model_len={manifest.model.max_model_len:,}; long requests cannot run")
    return []


def _known_label() -> str:
    from cluster.plan_memory import ACCELERATOR_LABEL, ACCELERATOR_MEMORY_GIB

    return f"{ACCELERATOR_LABEL}: {'/'.join(ACCELERATOR_MEMORY_GIB)}"


def _expert_parallel_line(manifest: Manifest, pool: PoolSpec, facts: ModelFacts | None,
                          warnings: list[str], errors: list[str]) -> str | None:
    ep = pool.expert_parallel
    if ep is None:
        return None
    physical = _physical_experts(facts, pool)
    redundant = physical is not None and physical != facts.num_experts
    if physical and physical % ep.size and redundant:
        errors.append(f"pool {pool.name}: EPLB needs its {physical} expert slots ({facts.num_experts} routed + "
                      f"{ep.num_redundant_experts} redundant) to split evenly over {ep.size} ranks; set "
                      "expert_parallel.num_redundant_experts so that the sum is a multiple of expert_parallel.size")
    elif physical and physical % ep.size:
        warnings.append(f"pool {pool.name}: {facts.num_experts} routed experts do not split evenly over "
                        f"{ep.size} ranks; the first ranks hold one more (uneven load)")
    if manifest.accelerator.value == "cpu":
        eplb = "EPLB unavailable (vLLM's CPU build rejects it; per-expert load is still exported)"
    else:
        eplb = (f"EPLB on, {ep.num_redundant_experts} redundant experts" if ep.enable_eplb else "EPLB off")
        if redundant and not physical % ep.size:
            eplb += f" ({physical} slots, {physical // ep.size} per rank)"
    return (f"{ep.size} ranks per replica (data-parallel attention, expert-parallel MoE), "
            f"{ep.placement_strategy}, {eplb}")


def _selector(pool: PoolSpec) -> str:
    labels = pool.placement.node_labels
    return "nodes with " + ", ".join(f"{k}={v}" for k, v in labels.items()) if labels else "any node"


def _kv_capacity(manifest: Manifest, pool: PoolSpec, facts: ModelFacts | None,
                 memory: RankMemory | None) -> tuple[int | None, int | None]:
    if manifest.accelerator.value != "cpu":
        if memory is None or memory.usable_bytes is None:
            return None, None  # vLLM sizes GPU KV cache from free memory at start-up
        return memory.kv_cache_bytes, memory.kv_tokens
    kv_bytes = int(pool.engine.cpu_kvcache_space_gib * GIB)
    if memory is None or memory.kv_bytes_per_token <= 0:
        return kv_bytes, None
    return kv_bytes, memory.kv_tokens


def render_plan(plan: Plan) -> str:
    lines = [f"application {plan.app_name}: model {plan.model_name}", f"endpoint     {plan.endpoint_url}/v1"]
    if plan.model_facts:
        f = plan.model_facts
        experts = f", {f.num_experts} routed experts/layer" if f.num_experts else ""
        attention = f", {f.attention}" if f.attention else ""
        lines.append(f"checkpoint   {_gib(f.weight_bytes)} weights, {f.num_layers} layers{experts}{attention}, "
                     f"{f.kv_bytes_per_token:,} KV bytes/token" + (f"  [{f.source}]" if f.source else ""))
    else:
        lines.append("checkpoint   not readable here (sizes unknown)")
    lines.append(f"ingress      on {plan.ingress_node}")
    if plan.kv_transfer:
        lines.append(f"kv transfer  {plan.kv_transfer}")
    if plan.kv_pool:
        lines.append(f"kv pool      {plan.kv_pool}")
    for pool in plan.pools:
        if pool.expert_parallel:
            lines.append(f"experts      pool {pool.name}: {pool.expert_parallel}")
    if plan.autoscaling:
        lines.append(f"autoscaling  {plan.autoscaling}")
    lines.append("")
    node_width = max([34] + [len(r.node) + 2 for pool in plan.pools for r in pool.replicas])
    lines.append(f"{'pool':<12}{'role':<11}{'replica':<9}{'rank':<7}{'experts':<10}{'node':<{node_width}}"
                 f"{'cpus':>6}{'gpus':>6}{'count':>7}  {'weights':<11}kv cache per rank")
    for pool in plan.pools:
        kv = _kv_cell(plan, pool)
        # A declared local cluster has a handful of ranks, each on a named node: list them all.
        for group in (_identical_rows(pool) if not plan.node_cpu_reserved else [[r] for r in pool.replicas]):
            first = group[0]
            replicas = _span([r.replica_index for r in group])
            ranks = "-" if first.rank is None else _span([r.rank for r in group])
            if first.experts and len(group) == 1:
                experts = f"{first.experts[0]}-{first.experts[1]}"
            elif first.experts:
                experts = f"{first.experts[1] - first.experts[0] + 1} each"
            else:
                experts = "1/" + str(len({r.rank for r in pool.replicas})) if first.rank is not None else "all"
            weights = "?" if first.weight_bytes is None else _gib(first.weight_bytes)
            lines.append(f"{pool.name:<12}{pool.role:<11}{replicas:<9}{ranks:<7}{experts:<10}{first.node:<{node_width}}"
                         f"{first.num_cpus:>6g}{first.num_gpus:>6g}{'x' + str(len(group)):>7}  {weights:<11}{kv}")
    if plan.node_cpu_reserved:
        lines.append("")
        lines.append("cpus reserved per node: " + ", ".join(f"{k}={v:g}" for k, v in plan.node_cpu_reserved.items()))
    for warning in plan.warnings:
        lines.append(f"warning: {warning}")
    for error in plan.errors:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def _kv_cell(plan: Plan, pool: PoolPlan) -> str:
    memory = pool.rank_memory
    if pool.kv_cache_bytes_per_replica is None:
        return "auto (GPU memory)"
    kv = _gib(pool.kv_cache_bytes_per_replica)
    if pool.kv_cache_tokens_per_replica is not None:
        bound = "<= " if memory is not None and memory.usable_bytes is not None else ""
        kv = f"{bound}{kv} = {bound}{pool.kv_cache_tokens_per_replica:,} tokens"
        if memory is not None and memory.usable_bytes is not None:
            kv += f" ({_gib(memory.device_memory_bytes)} x {memory.usable_bytes / memory.device_memory_bytes:.2f} - weights)"
    if pool.kv_cache_dtype != "auto" and memory is not None:
        kv += f", {pool.kv_cache_dtype} KV: {memory.kv_bytes_per_token:,} B/token"
    return kv


def _identical_rows(pool: PoolPlan) -> list[list[ReplicaPlacement]]:
    """Consecutive ranks that differ only in index (and which experts they hold) form one row."""
    groups: list[list[ReplicaPlacement]] = []
    for rep in pool.replicas:
        if groups and _row_key(groups[-1][0]) == _row_key(rep):
            groups[-1].append(rep)
        else:
            groups.append([rep])
    return groups


def _row_key(rep: ReplicaPlacement) -> tuple:
    held = rep.experts[1] - rep.experts[0] if rep.experts else None
    return (rep.node, rep.num_cpus, rep.num_gpus, rep.weight_bytes, held, rep.rank is None)


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= (1 << 28) else f"{n / (1 << 20):.1f} MiB"
