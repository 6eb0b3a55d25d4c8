"""The only module that wires Serve: manifest -> Serve application.

Ingress (OpenAIIngress) -> engine pool. A pool's replica is one LLMServer (one vLLM engine), or,
when the pool sets expert_parallel, one ExpertParallelGroup (N vLLM ranks on the N bundles of
the replica's placement group).
"""

from __future__ import annotations

import secrets

from typing import Any

from ray import serve
from ray.serve import Application

from cluster.manifest import Accelerator, Manifest, PoolRole, PoolSpec
from cluster.manifest_timeouts import effective_timeouts
from cluster.plan import INGRESS_NUM_CPUS
from deployments.expert_parallel.expert_group import ExpertParallelGroup
from deployments.engine.llm_server import LLMServer
from deployments.frontend.openai_ingress import OpenAIIngress

INGRESS_DEPLOYMENT = "openai-ingress"
DEFAULT_BLOCK_SIZE = 16  # the router's prefix granularity where the manifest sets no engine block size
FALLBACK_CAPACITY_BLOCKS = 4096  # the model's KV size per token is unknown


def engine_env(manifest: Manifest, pool: PoolSpec) -> dict[str, str]:
    """Environment of a pool's engine processes: CPU-backend settings, then the pool's own."""
    env: dict[str, str] = {}
    if manifest.accelerator is Accelerator.cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{pool.engine.cpu_kvcache_space_gib:g}"
        # Several engines share this machine's cores; pinning ("auto") refuses two per NUMA node.
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    env.update(pool.env)
    return env


def engine_actor_options(manifest: Manifest, pool: PoolSpec) -> dict[str, Any]:
    options: dict[str, Any] = {
        "num_cpus": pool.placement.num_cpus,
        "num_gpus": pool.placement.num_gpus,
        "runtime_env": {"env_vars": engine_env(manifest, pool)},
    }
    if pool.placement.resources:
        options["resources"] = dict(pool.placement.resources)
    if pool.placement.node_labels:
        options["label_selector"] = dict(pool.placement.node_labels)
    return options


def rank_bundle(pool: PoolSpec) -> dict[str, float]:
    """What one rank of an expert-parallel group reserves (one placement-group bundle)."""
    bundle = {"CPU": pool.placement.num_cpus, **pool.placement.resources}
    if pool.placement.num_gpus:
        bundle["GPU"] = pool.placement.num_gpus
    return bundle


def expert_group_options(manifest: Manifest, pool: PoolSpec) -> dict[str, Any]:
    """Serve options of an expert-parallel pool: one placement group of N bundles per replica.

    The replica (rank 0) takes bundle 0; it starts ranks 1..N-1 on the other bundles.
    """
    ep = pool.expert_parallel
    actor = engine_actor_options(manifest, pool)
    actor.pop("label_selector", None)  # the bundles carry the node selector instead
    options: dict[str, Any] = {
        "ray_actor_options": actor,
        "placement_group_bundles": [rank_bundle(pool) for _ in range(ep.size)],
        "placement_group_strategy": ep.placement_strategy,
    }
    if pool.placement.node_labels:
        options["placement_group_bundle_label_selector"] = [dict(pool.placement.node_labels)] * ep.size
    return options


def replica_count_options(manifest: Manifest, pool: PoolSpec) -> dict[str, Any]:
    """A fixed `num_replicas`, or Serve autoscaling driven by our coordinated policy.

    Serve's own damping is off (no delays, factor 1): cooldowns and hysteresis belong to the
    controller, which sees all pools; Serve only enforces the bounds.
    """
    if pool.autoscaling is None:
        return {"num_replicas": pool.replicas}
    from autoscaler.settings import settings_from_manifest

    return {"autoscaling_config": {
        "min_replicas": pool.autoscaling.min_replicas,
        "max_replicas": pool.autoscaling.max_replicas,
        "initial_replicas": pool.replicas,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "downscale_to_zero_delay_s": 0.0,
        "upscaling_factor": 1.0,
        "downscaling_factor": 1.0,
        "policy": {
            "policy_function": "autoscaler.serve_policy:CoordinatedPoolPolicy",
            "policy_kwargs": {"settings": settings_from_manifest(manifest).to_json(),
                              "record_path": manifest.autoscaling.record_path},
        },
    }}


def engine_kv_settings(manifest: Manifest, pool_address: dict | None, grant_secret: str = "",
                       role: str = "colocated") -> dict | None:
    """What an engine's connector gets from the manifest: the transfer settings (P/D), the
    application's lease-grant secret and the KV pool's settings with its master's address (the
    segment it contributes depends on its pool's `role`); None when an engine needs no connector."""
    if not manifest.disaggregated and pool_address is None:
        return None
    settings = manifest.kv_transfer.model_dump()
    settings["grant_secret"] = grant_secret
    # Only a prefill pool's engines lend their blocks; every other engine's transfer port
    # answers no read (decode and colocated engines hold whole conversations).
    settings["lends_kv"] = manifest.disaggregated and role == PoolRole.prefill
    settings["max_connections"] = transfer_connections(manifest)
    if pool_address is not None:
        spec = manifest.kv_pool
        settings["pool"] = {
            "backend": spec.backend, "master_address": pool_address["master_address"],
            "metadata_url": pool_address["metadata_url"], "protocol": spec.protocol,
            "device_name": spec.device_name, "segment_bytes": spec.segment_mib_for(role) << 20,
            "local_buffer_bytes": spec.local_buffer_mib << 20, "key_prefix": manifest.name,
            "failure_policy": manifest.kv_transfer.failure_policy, "retry_after_s": spec.retry_after_s,
            "max_pending_stores": spec.max_pending_stores, "max_store_wait_s": spec.max_store_wait_s,
            "weights_id": spec.weights_id,
        }
        if spec.sessions is not None:
            settings["pool"].update(session_pin_s=spec.sessions.idle_s,
                                    session_pin_share=spec.sessions.max_pinned_share)
        if spec.disk is not None:
            # Each engine writes under its own folder of it (the connector adds the engine's id).
            settings["pool"].update(disk_dir=f"{spec.disk.path}/{manifest.name}",
                                    disk_bytes=int(spec.disk.capacity_gib * (1 << 30)))
    return settings


# Per pulling engine worker: its pull threads' pooled connections, its engine core's releaser
# and one to spare; plus the serving engine's own stats export and its replica's releases.
CONNECTIONS_PER_PULLER = 2
CONNECTIONS_SPARE = 16
MIN_CONNECTIONS = 64


def transfer_connections(manifest: Manifest) -> int:
    """How many connections an engine's KV transfer server serves at once: sized from the
    topology (every decode worker at full scale may pull from one prefill engine at once),
    not a constant that a second decode group outgrows."""
    if not manifest.disaggregated:
        return MIN_CONNECTIONS
    decode = manifest.pool_with_role(PoolRole.decode)
    replicas = decode.autoscaling.max_replicas if decode.autoscaling is not None else decode.replicas
    workers = replicas * max(
        decode.expert_parallel.size if decode.expert_parallel is not None else 1,
        decode.engine.tensor_parallel_size)
    from kv_transfer.settings import ConnectorSettings

    per_worker = ConnectorSettings.max_concurrent_pulls + CONNECTIONS_PER_PULLER
    return max(MIN_CONNECTIONS, workers * per_worker + CONNECTIONS_SPARE)


def _engine_deployment(manifest: Manifest, pool: PoolSpec, model: dict, model_path: str,
                       pool_address: dict | None = None, grant_secret: str = ""):
    kv_transfer = engine_kv_settings(manifest, pool_address, grant_secret, pool.role)
    if pool.expert_parallel is not None:
        rank_options = engine_actor_options(manifest, pool)
        rank_options.pop("label_selector", None)
        return serve.deployment(ExpertParallelGroup).options(
            name=pool.name,
            **replica_count_options(manifest, pool),
            **routing_options(manifest, pool, model_path),
            max_ongoing_requests=pool.engine.max_num_seqs * 4 * pool.expert_parallel.size,
            # Short period: a group with a dead rank fails its requests at once but only
            # leaves the pool when Serve's health check notices.
            health_check_period_s=2,
            health_check_timeout_s=60,
            graceful_shutdown_timeout_s=5,
            **expert_group_options(manifest, pool),
        ).bind(model, pool.engine.model_dump(), model_path, kv_transfer, pool.expert_parallel.model_dump(),
               rank_options, manifest.accelerator.value, pool.name, metrics=manifest.observability.metrics,
               request_timeouts=effective_timeouts(manifest), kv_events=follows_kv_events(pool))
    return serve.deployment(LLMServer).options(
        name=pool.name,
        **replica_count_options(manifest, pool),
        **routing_options(manifest, pool, model_path),
        ray_actor_options=engine_actor_options(manifest, pool),
        # Admit more than one engine step's worth so the engine's own scheduler batches them.
        max_ongoing_requests=pool.engine.max_num_seqs * 4,
        health_check_period_s=10,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=5,
    ).bind(model, pool.engine.model_dump(), model_path, kv_transfer, pool=pool.name,
           metrics=manifest.observability.metrics, kv_events=follows_kv_events(pool),
           request_timeouts=effective_timeouts(manifest))


def routing_options(manifest: Manifest, pool: PoolSpec, model_path: str) -> dict[str, Any]:
    """Serve's request router for the pool's routing policy (none: Serve's default router)."""
    if pool.routing.policy == "serve_default":
        return {}
    from ray.serve.config import RequestRouterConfig

    from deployments.routing.serve_router import PolicyRequestRouter

    block_size = pool.engine.block_size or DEFAULT_BLOCK_SIZE
    kwargs = pool.routing.router_kwargs(pool.name, block_size, engine_capacity_blocks(manifest, pool, model_path, block_size),
                                        metrics=manifest.observability.metrics,
                                        pool_capacity_blocks=kv_pool_capacity_blocks(manifest, model_path, block_size))
    return {"request_router_config": RequestRouterConfig(
        request_router_class=PolicyRequestRouter, request_router_kwargs=kwargs,
        request_routing_stats_period_s=pool.routing.stats_period_s)}


def follows_kv_events(pool: PoolSpec) -> bool:
    """Engines publish their cache for the prefix router (a cache that is off has nothing to say)."""
    return pool.routing.policy == "prefix" and pool.routing.kv_events and pool.engine.enable_prefix_caching


def _model_facts(manifest: Manifest, model_path: str):
    """The checkpoint's sizes (config.json) that the routers' capacity estimates come from."""
    from pathlib import Path

    from cluster.model_facts import read_model_facts

    return read_model_facts(Path(model_path), manifest.model.dtype, model_name=manifest.model.name,
                            quantization=manifest.model.quantization)


def kv_pool_capacity_blocks(manifest: Manifest, model_path: str, block_size: int) -> int:
    """Blocks the KV pool holds (the prefix router's estimate of what any replica can load); 0
    without a pool."""
    if not manifest.kv_pool.enabled:
        return 0
    from cluster.plan import kv_pool_capacity_tokens

    return kv_pool_capacity_tokens(manifest, _model_facts(manifest, model_path)) // block_size


def engine_capacity_blocks(manifest: Manifest, pool: PoolSpec, model_path: str, block_size: int) -> int:
    """KV blocks one engine of the pool holds (the router's estimate of what its cache keeps)."""
    override = pool.engine.extra_args.get("num_gpu_blocks_override")
    if override:
        return int(override)
    from cluster.plan import make_plan

    plan = next(p for p in make_plan(manifest, _model_facts(manifest, model_path)).pools if p.name == pool.name)
    tokens = plan.kv_cache_tokens_per_replica
    return max(tokens // block_size, 1) if tokens else FALLBACK_CAPACITY_BLOCKS


def build_app(manifest: Manifest, model_path: str, pool_address: dict | None = None) -> Application:
    """colocated: ingress -> engine pool; disaggregated: ingress -> prefill pool, then decode pool.
    `pool_address`: the running KV pool's master (cluster.kv_pool_service.ensure_pool)."""
    model = manifest.model.model_dump()
    http = manifest.http.model_dump()
    if manifest.http.auth.enabled:
        # Fail the deploy here, with the fix, rather than in a replica that Serve restarts forever.
        # Keys are read again by the ingress replica; they are not passed to it.
        from deployments.frontend.api_keys import load_api_keys

        load_api_keys(manifest.http.auth.api_keys_env, manifest.http.auth.api_keys_file)
    # One secret per application build, shared by its engines only, whenever they run a KV
    # connector (P/D, or any pool with a KV pool): prefill signs the lease grants that decode
    # checks before it pulls and presents to read KV (kv_transfer/grants.py); an engine with
    # no secret lends and pulls nothing. A redeploy makes a new one; pulls between old and new
    # replicas during the rollout fail into the failure policy.
    grant_secret = secrets.token_hex(32)
    if manifest.disaggregated:
        engine = _engine_deployment(manifest, manifest.pool_with_role(PoolRole.decode), model, model_path,
                                    pool_address, grant_secret)
        prefill = _engine_deployment(manifest, manifest.pool_with_role(PoolRole.prefill), model, model_path,
                                     pool_address, grant_secret)
    else:
        engine = _engine_deployment(manifest, manifest.pool_with_role(PoolRole.colocated), model, model_path,
                                    pool_address, grant_secret)
        prefill = None

    serving = manifest.pool_with_role(PoolRole.decode if manifest.disaggregated else PoolRole.colocated)
    admission = manifest.admission
    admission_limits = (admission.limits_per_ingress(serving, manifest.http.ingress_replicas)
                        if admission.enabled else None)
    ingress_options: dict[str, Any] = {"num_cpus": INGRESS_NUM_CPUS}
    if manifest.local_cluster and manifest.local_cluster.nodes[0].labels:
        ingress_options["label_selector"] = dict(manifest.local_cluster.nodes[0].labels)
    return serve.deployment(OpenAIIngress).options(
        name=INGRESS_DEPLOYMENT,
        num_replicas=manifest.http.ingress_replicas,
        ray_actor_options=ingress_options,
        max_ongoing_requests=1024,
    ).bind(engine, model, http, model_path, prefill=prefill,
           allow_fault_injection=manifest.kv_transfer.allow_fault_injection, slo=manifest.slo.model_dump(),
           metrics=manifest.observability.metrics, admission=admission_limits,
           priority_header=admission.priority_header,
           local_prefill_below_tokens=manifest.kv_transfer.local_prefill_below_tokens,
           local_prefill_hit_fraction=manifest.kv_transfer.local_prefill_hit_fraction if manifest.disaggregated else None,
           decode_pool=serving.name, request_timeouts=effective_timeouts(manifest),
           prefill_pool=manifest.pool_with_role(PoolRole.prefill).name if manifest.disaggregated else "prefill")
