"""Builds the pool's parts for one connector instance from vLLM's config (the vLLM adapter of
the pool; everything it builds takes plain data).

What two engines must agree on to share a block goes into the key space (`keys`): the model
and its dtype, the checkpoint's fingerprint (weights files, config, quantization, hf_overrides,
rope, load format, vLLM version: `keys.Checkpoint`), the KV cache spec of every group (layout,
head sizes, block size, dtype), the block hash algorithm with its seed, and the tensor-parallel
size. Data-parallel and expert-parallel ranks hold whole requests, so their blocks are
interchangeable and not keyed.

Weights are identified by each file's name, size and version (`weight_files`), not by a hash of
their content: that would read tens to hundreds of GB at every engine start. The version is the
Hub cache's blob name where the file links into that cache (a content hash, equal on every node),
else its mtime_ns (replacing a file changes it; a copy that keeps the old mtime and size while
changing bytes does not, which no tool we know of does by accident). Copies with other mtimes on
other nodes then get their own key space (the pool misses, never serves stale KV); the pool's
`weights_id` setting names the weights instead for such clusters.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from kv_transfer.pool.health import PoolHealth
from kv_transfer.pool.keys import Checkpoint, KeySpace, WeightFile, checkpoint_fingerprint, space_digest
from kv_transfer.pool.store import PoolSettings

logger = logging.getLogger(__name__)

WARM_UP_S = 10.0  # the scheduler's wait to join the pool at engine start
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")
ROPE_FIELDS = ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")


def key_space(settings: PoolSettings, vllm_config: Any, kv_cache_config: Any) -> KeySpace:
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    cache = vllm_config.cache_config
    model = vllm_config.model_config
    specs = sorted(repr(group.kv_cache_spec) for group in getattr(kv_cache_config, "kv_cache_groups", ()))
    try:
        seed = get_none_hash_seed()
    except Exception:  # not initialised yet in this process: vLLM's default for sha256
        seed = "default"
    fingerprint = checkpoint_fingerprint(checkpoint(vllm_config, settings.weights_id))
    digest = space_digest(model.model, model.dtype, fingerprint, cache.block_size, cache.cache_dtype,
                          cache.prefix_caching_hash_algo, seed, *specs)
    logger.info("kv pool: key space %s/%s (checkpoint %s)", settings.key_prefix, digest, fingerprint)
    return KeySpace(settings.key_prefix, digest, vllm_config.parallel_config.tensor_parallel_size)


def checkpoint(vllm_config: Any, weights_id: str = "") -> Checkpoint:
    """The engine's checkpoint as plain values: vLLM's model config plus its files on disk."""
    import vllm

    model = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)
    directory = checkpoint_dir(str(model.model), getattr(model, "revision", None), getattr(load, "download_dir", None))
    weights, config_json, index_json = weight_files(directory) if directory is not None else ((), b"", b"")
    load_format = str(getattr(load, "load_format", "auto"))
    if not weights and not weights_id and load_format != "dummy":
        logger.warning("kv pool: found no weights files of %s (looked in %s); the pool's key space does not "
                       "cover the weights: set the pool's weights_id, and change it with the weights",
                       model.model, directory)
    text_config = getattr(model, "hf_text_config", None) or getattr(model, "hf_config", None)
    rope = {name: getattr(text_config, name) for name in ROPE_FIELDS if getattr(text_config, name, None) is not None}
    return Checkpoint(weights, config_json, index_json, model.quantization, model.hf_overrides, rope,
                      load_format, vllm.__version__, weights_id)


def checkpoint_dir(model: str, revision: str | None, download_dir: str | None) -> Path | None:
    """Where the model's files are: the path itself, or the Hub cache's snapshot of the model
    (vLLM downloaded it there before any connector exists); None when neither is found."""
    path = Path(model)
    if path.is_dir() or path.is_file():  # a file: a single-file checkpoint such as GGUF
        return path
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json", cache_dir=download_dir, revision=revision)
    except Exception:  # noqa: BLE001 - not a Hub id, or no usable cache: the caller warns
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def weight_files(directory: Path) -> tuple[tuple[WeightFile, ...], bytes, bytes]:
    """(weights files, config.json, weights index) of a checkpoint directory (or single file):
    a directory listing and a few small reads, once per connector."""
    if directory.is_file():
        return (_weight_file(directory, directory.name),), b"", b""
    weights = tuple(_weight_file(entry, entry.name) for entry in sorted(directory.iterdir())
                    if entry.name.endswith(WEIGHT_SUFFIXES) and entry.is_file())
    indexes = [entry.read_bytes() for entry in sorted(directory.iterdir()) if entry.name.endswith(INDEX_SUFFIXES)]
    config = directory / "config.json"
    return weights, config.read_bytes() if config.is_file() else b"", b"\n".join(indexes)


def _weight_file(path: Path, name: str) -> WeightFile:
    stat = path.stat()  # follows a Hub cache link to its blob
    target = Path(os.path.realpath(path))
    in_blob_store = target.parent.name == "blobs" and len(target.name) in (40, 64) and _is_hex(target.name)
    return WeightFile(name, stat.st_size, f"blob:{target.name}" if in_blob_store else f"mtime_ns:{stat.st_mtime_ns}")


def _is_hex(text: str) -> bool:
    try:
        int(text, 16)
    except ValueError:
        return False
    return True


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
                         vllm_config.cache_config.block_size, PoolHealth(settings.retry_after_s),
                         sessions=settings.session_pin_s > 0)


def worker_tier(settings: PoolSettings, vllm_config: Any, kv_cache_config: Any, tp_rank: int):
    """`tp_rank`: the worker's tensor-parallel rank (its shard's keys)."""
    from kv_transfer.pool.session_pins import SessionPins
    from kv_transfer.pool.worker_tier import PoolWorker

    pins = None
    if settings.session_pin_s > 0:  # pins live in this engine's own segment: a share of it at most
        pins = SessionPins(settings.session_pin_s, int(settings.session_pin_share * settings.segment_bytes))
    # Staging: what one batched get or put moves; the store's own buffer is the natural size.
    return PoolWorker(store_factory(settings), key_space(settings, vllm_config, kv_cache_config), tp_rank,
                      PoolHealth(settings.retry_after_s), staging_bytes=settings.local_buffer_bytes, pins=pins)
