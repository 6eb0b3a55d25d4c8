"""Pool keys: vLLM's chained block hashes in a namespace that only identical engines share.

A block's KV depends on every token before it (vLLM's chained hash covers that), and on the
model, its weights' dtype, the KV cache layout and block size, and the tensor-parallel rank
that holds this slice of heads. Two engines may share an object only if all of these agree,
so they all go into the key: `{prefix}/{space digest}/{block hash hex}/tp{rank}`.

vLLM's hash is reproducible across processes only with a cryptographic algorithm (sha256 or
sha256_cbor: NONE_HASH then comes from a fixed seed, or PYTHONHASHSEED when set); the engine
pins the algorithm, and the algorithm and seed are part of the space digest too.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class KeySpace:
    prefix: str  # the application: two applications never share objects
    digest: str  # model, dtype, block size, layout, hash algorithm and seed (see space_digest)
    tp_size: int = 1

    def key(self, block_hash: bytes, tp_rank: int) -> str:
        return f"{self.prefix}/{self.digest}/{block_hash.hex()}/tp{tp_rank}"

    def keys_all_ranks(self, block_hash: bytes) -> list[str]:
        """A block is in the pool only when every tensor-parallel rank's slice is."""
        return [self.key(block_hash, rank) for rank in range(self.tp_size)]


def space_digest(*parts: object) -> str:
    """A short, stable digest of everything that must match for two engines to share KV."""
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).hexdigest()
