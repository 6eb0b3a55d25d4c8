"""Pool keys: vLLM's chained block hashes in a namespace that only identical engines share.

A block's KV depends on every token before it (vLLM's chained hash covers that), and on the
model, its weights' dtype, the KV cache layout and block size, and the tensor-parallel rank
that holds this slice of heads. Two engines may share an object only if all of these agree,
so they all go into the key: `{prefix}/{space digest}/{block hash hex}/tp{rank}`.

vLLM's hash is reproducible across processes only with a cryptographic algorithm (sha256 or
sha256_cbor: NONE_HASH then comes from a fixed seed, or PYTHONHASHSEED when set); the engine
pins the algorithm, and the algorithm and seed are part of the space digest too.

The model *path* does not identify the weights: weights replaced at the same path, another
quantization, hf_overrides or rope settings, or another vLLM (kernels, defaults) compute other
KV for the same tokens, and the pool outlives engines. So the digest also takes the checkpoint's
fingerprint (`checkpoint_fingerprint`); engine_wiring reads its inputs from vLLM and the disk.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KeySpace:
    prefix: str  # the application: two applications never share objects
    digest: str  # model, checkpoint, dtype, block size, layout, hash algorithm and seed (see space_digest)
    tp_size: int = 1

    def key(self, block_hash: bytes, tp_rank: int) -> str:
        return f"{self.prefix}/{self.digest}/{block_hash.hex()}/tp{tp_rank}"

    def keys_all_ranks(self, block_hash: bytes) -> list[str]:
        """A block is in the pool only when every tensor-parallel rank's slice is."""
        return [self.key(block_hash, rank) for rank in range(self.tp_size)]


def space_digest(*parts: object) -> str:
    """A short, stable digest of everything that must match for two engines to share KV."""
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class WeightFile:
    """One weights file of a checkpoint, as the fingerprint sees it."""

    name: str  # relative to the checkpoint's directory
    size_bytes: int
    # The Hub cache's blob name when the file links into one (a hash of the content, the same on
    # every node); otherwise the file's mtime_ns (a replaced file gets a new one).
    version: str


@dataclass(frozen=True)
class Checkpoint:
    """What a model's KV depends on besides the KV cache spec, as plain values."""

    weights: tuple[WeightFile, ...]  # empty when the weights could not be listed
    config_json: bytes = b""  # config.json as on disk
    weights_index_json: bytes = b""  # *.safetensors.index.json / *.bin.index.json, if any
    quantization: str | None = None  # vLLM's model_config.quantization (None: from config.json)
    hf_overrides: Any = None  # vLLM's model_config.hf_overrides (a dict, or a callable)
    rope: Any = None  # rope settings of the effective (overridden) text config
    load_format: str = "auto"  # "dummy" weights are vLLM's seeded random ones, not the files
    vllm_version: str = ""
    # The operator's name for the weights (PoolSettings.weights_id); when set it stands for
    # `weights`, so that copies of a checkpoint whose mtimes differ across nodes share the pool.
    weights_id: str = ""


def checkpoint_fingerprint(checkpoint: Checkpoint) -> str:
    """sha256 (hex, 16 bytes) of everything in `checkpoint`; equal inputs give equal output in
    every process (callables count by qualified name, never by their address)."""
    weights = ([checkpoint.weights_id] if checkpoint.weights_id
               else [[f.name, f.size_bytes, f.version] for f in sorted(checkpoint.weights, key=lambda f: f.name)])
    document = {
        "weights": weights,
        "config_json": hashlib.sha256(checkpoint.config_json).hexdigest(),
        "weights_index_json": hashlib.sha256(checkpoint.weights_index_json).hexdigest(),
        "quantization": checkpoint.quantization,
        "hf_overrides": checkpoint.hf_overrides,
        "rope": checkpoint.rope,
        "load_format": checkpoint.load_format,
        "vllm_version": checkpoint.vllm_version,
    }
    text = json.dumps(document, sort_keys=True, default=_stable_text)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _stable_text(value: Any) -> Any:
    """JSON for what json cannot write: a callable by name (its repr holds an address that
    differs per process), anything else by repr."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if isinstance(value, (set, frozenset)):  # iteration order follows per-process string hashing
        return sorted(map(repr, value))
    return repr(value)
