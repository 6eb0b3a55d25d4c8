"""Checksum of pool objects: XXH3-64 (python-xxhash), fed 64 KiB at a time so it keeps the GIL.

Why XXH3 and not CRC-32: a pool load verifies every block before it reaches the KV cache,
so the checksum is on every load's path. Measured here (32 blocks of 256 KiB, the tiny
model's CPU block; `benchmarks/bench_pool_load.py`, its checksum rows): libz's CRC-32 1.9 ms,
XXH3-64 0.35 ms. CRC-32 was half of a pool load's own work around Mooncake's read.
XXH3's value does not depend on which SIMD path computes it, so machines with and without
AVX-512 agree on every object.

Why 64 KiB at a time: a pool load runs on a connector thread inside the engine process,
whose main thread (vLLM's busy loop) holds the GIL most of the time. python-xxhash lets go
of the GIL for any buffer over 64 KiB, and every release then waits up to one switch interval
(5 ms) to get it back. Measured with a Python thread spinning beside it: 32 one-shot
`xxh3_64_intdigest` calls took 160 ms. Updates of at most 64 KiB keep the GIL: 0.35 ms.
(The same trap made `zlib.crc32`, which releases over 5 KiB, 100x slower beside a busy loop.)
"""

from __future__ import annotations

import xxhash

# python-xxhash releases the GIL for a buffer larger than this (XXHASH_GIL_MINSIZE in its C
# source, xxhash 4.x); an update of at most this many bytes keeps it.
GIL_KEEPING_CHUNK = 64 * 1024


def xxh3_64(data) -> int:
    """XXH3-64 of a bytes-like object (bytes, memoryview, C-contiguous numpy array), computed
    without releasing the GIL; equals `xxhash.xxh3_64_intdigest(data)`."""
    view = memoryview(data).cast("B")
    state = xxhash.xxh3_64()
    for start in range(0, len(view), GIL_KEEPING_CHUNK):
        state.update(view[start:start + GIL_KEEPING_CHUNK])
    return state.intdigest()
