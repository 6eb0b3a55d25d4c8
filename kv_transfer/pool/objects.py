"""Pool objects: one KV block of every layer, behind a header that proves what it holds.

An object is written once and never changed (its key names the tokens it caches), but a store
can still hand back the wrong bytes: a key collision across models or layouts, a partial
object, memory that went bad, a bug. So every object starts with a fixed 64-byte header

    magic "MSKV" | version u16 | reserved u16 | key digest 16B | token digest 16B |
    layers u32 | page bytes u64 | payload XXH3-64 u64 | reserved u32

and a load uses the payload only if every field matches what the loading engine expects:
the key it asked for, the token ids of that block, its own layout, and the checksum of the
bytes that arrived. Anything else is a `CorruptObject`, and the engine recomputes the block.
Pure: bytes in, bytes out; no torch, no store.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Sequence

from kv_transfer.errors import KVTransferError
from kv_transfer.pool.checksum import xxh3_64

MAGIC = b"MSKV"
# 2: the payload's checksum is XXH3-64 (1 had CRC-32 and the payload's length); a version-1
# object left in a pool is refused like any foreign object and its block recomputed.
VERSION = 2
HEADER_BYTES = 64
_FORMAT = "<4sHH16s16sIQQ4x"  # 4+2+2+16+16+4+8+8 + 4 reserved zero bytes = 64 ("<": no alignment)
assert struct.calcsize(_FORMAT) == HEADER_BYTES


class CorruptObject(KVTransferError):
    """A pool object whose header or checksum does not match what the load expected."""


@dataclass(frozen=True)
class BlockLayout:
    """What one block looks like in this engine's KV cache (every layer, one page each)."""

    num_layers: int
    page_bytes: int  # bytes of one block of one layer

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * self.page_bytes

    @property
    def object_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def token_digest(token_ids: Sequence[int]) -> bytes:
    """Digest of one block's token ids (int32 little-endian), independent of vLLM's hashing."""
    return hashlib.blake2b(struct.pack(f"<{len(token_ids)}i", *token_ids), digest_size=16).digest()


def payload_checksum(payload: memoryview | bytes) -> int:
    return xxh3_64(payload)  # keeps the GIL: see checksum.py


def encode_header(key: str, tokens: bytes, layout: BlockLayout, checksum: int) -> bytes:
    return struct.pack(_FORMAT, MAGIC, VERSION, 0, key_digest(key), tokens, layout.num_layers,
                       layout.page_bytes, checksum)


def verify(obj: memoryview, key: str, tokens: bytes, layout: BlockLayout) -> memoryview:
    """The payload of `obj` if it is the object `key` for these tokens in this layout."""
    if len(obj) != layout.object_bytes:
        raise CorruptObject(f"{key}: {len(obj)} bytes, expected {layout.object_bytes}")
    magic, version, _, kdigest, tdigest, layers, page, checksum = struct.unpack_from(_FORMAT, obj)
    if magic != MAGIC or version != VERSION:
        raise CorruptObject(f"{key}: not a moe-serve KV object (magic {magic!r}, version {version})")
    if kdigest != key_digest(key):
        raise CorruptObject(f"{key}: header names another key")
    if tdigest != tokens:
        raise CorruptObject(f"{key}: cached for other token ids")
    if (layers, page) != (layout.num_layers, layout.page_bytes):
        raise CorruptObject(f"{key}: layout {layers} layers x {page} B, expected "
                            f"{layout.num_layers} x {layout.page_bytes} B")
    payload = obj[HEADER_BYTES:]
    if payload_checksum(payload) != checksum:
        raise CorruptObject(f"{key}: payload checksum mismatch (partial or damaged object)")
    return payload
