"""Builds the pool's parts for one connector instance from vLLM's config (the vLLM adapter of
the pool; everything it builds takes plain data).

What two engines must agree on to share a block goes into the key space (`keys`): the model
and its dtype, the KV cache spec of every group (layout, head sizes, block size, dtype), the
block hash algorithm with its seed, and the tensor-parallel size. Data-parallel and
expert-parallel ranks hold whole requests, so their blocks are interchangeable and not keyed.
"""

from __future__ import annotations

from typing import Any

from kv_transfer.pool.health import PoolHealth
from kv_transfer.pool.keys import KeySpace, space_digest
from kv_transfer.pool.store import PoolSettings

WARM_UP_S = 10.0  # the scheduler's wait to join the pool at engine start


def key_space(settings: PoolSettings, vllm_config: Any, kv_cache_config: Any) -> KeySpace:
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    cache = vllm_config.cache_config
    model = vllm_config.model_config
    specs = sorted(repr(group.kv_cache_spec) for group in getattr(kv_cache_config, "kv_cache_groups", ()))
    try:
        seed = get_none_hash_seed()
    except Exception:  # not initialised yet in this process: vLLM's default for sha256
        seed = "default"
    digest = space_digest(model.model, model.dtype, cache.block_size, cache.cache_dtype,
                          cache.prefix_caching_hash_algo, seed, *specs)
    return KeySpace(settings.key_prefix, digest, vllm_config.parallel_config.tensor_parallel_size)


def store_factory(settings: PoolSettings, lookup_only: bool = False):
    """The process's store client, created on first use (an engine starts with the pool down).
    The scheduler only looks up: where it runs in its own process it contributes no memory."""
    def store():
        from kv_transfer.pool.mooncake_shared import shared_store

        return shared_store(settings, lookup_only=lookup_only)

    return store


def scheduler_tier(settings: PoolSettings, vllm_config: Any, kv_cache_config: Any):
    from kv_transfer.pool.scheduler_tier import PoolScheduler

    return PoolScheduler(store_factory(settings, lookup_only=True), key_space(settings, vllm_config, kv_cache_config),
                         vllm_config.cache_config.block_size, PoolHealth(settings.retry_after_s))


def worker_tier(settings: PoolSettings, vllm_config: Any, kv_cache_config: Any):
    from kv_transfer.pool.worker_tier import PoolWorker

    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
    except Exception:  # no model-parallel group yet (unit tests)
        rank = 0
    # Staging: what one batched get or put moves; the store's own buffer is the natural size.
    return PoolWorker(store_factory(settings), key_space(settings, vllm_config, kv_cache_config), rank,
                      PoolHealth(settings.retry_after_s), staging_bytes=settings.local_buffer_bytes)
