"""Chained hashes of a prompt's full token blocks: the router's name for a prefix.

Block i's hash covers tokens [0, (i+1) * block_size), so two prompts share hash i exactly when
they share their first i+1 blocks. It is the router's own hash (stable across processes), not
vLLM's: the precise path maps engine block hashes through the same token blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None) -> tuple[int, ...]:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    full = len(token_ids) // block_size
    if max_blocks is not None:
        full = min(full, max_blocks)
    hashes = []
    parent = b""
    for index in range(full):
        block = token_ids[index * block_size:(index + 1) * block_size]
        digest = hashlib.blake2b(parent + b"|" + ",".join(map(str, block)).encode(), digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little"))
        parent = digest
    return tuple(hashes)
