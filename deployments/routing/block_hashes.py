"""Chained hashes of a prompt's full token blocks: the router's name for a prefix.

Block i's hash covers tokens [0, (i+1) * block_size), so two prompts share hash i exactly when
they share their first i+1 blocks. It is the router's own hash (stable across processes), not
vLLM's: the precise path maps engine block hashes through the same token blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def chain_hash(parent: int | None, block_tokens: Sequence[int]) -> int:
    """The hash of one full block given its parent block's hash (None: the first block)."""
    prefix = b"" if parent is None else parent.to_bytes(8, "little")
    digest = hashlib.blake2b(prefix + b"|" + ",".join(map(str, block_tokens)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> tuple[int, ...]:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(token_ids) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    hashes: list[int] = []
    parent = None
    for index in range(full):
        parent = chain_hash(parent, token_ids[index * block_size:(index + 1) * block_size])
        hashes.append(parent)
    return tuple(hashes)
