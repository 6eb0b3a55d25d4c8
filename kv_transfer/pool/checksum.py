"""CRC-32 of pool objects, computed without letting go of the GIL.

Why not `zlib.crc32`: it releases the GIL for any buffer over 5 KiB, and a pool load runs on a
connector thread inside the engine process, whose main thread (vLLM's busy loop) holds the GIL
most of the time. Every release then costs a wait of up to one switch interval (5 ms) to get
the GIL back. Measured with a Python thread spinning beside a load of 32 blocks of 256 KiB
(`benchmarks/bench_pool_load.py`, its "busy" rows): 32 CRCs took 104 ms, 3 ms each, for 0.06 ms of
work, and pool loads ran at 50-250 MB/s instead of ~900 MB/s.

So the same libz `crc32` is called through `ctypes.PyDLL`, which keeps the GIL for the call:
~60 us per 256 KiB block at ~4 GB/s, no hand-off. Same polynomial and values as `zlib.crc32`
(object format unchanged). Where libz cannot be loaded, `zlib.crc32` is used.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import zlib

import numpy as np


def _load_libz_crc32():
    name = ctypes.util.find_library("z")
    if not name:
        return None
    try:
        libz = ctypes.PyDLL(name)  # PyDLL: the GIL is held during calls (that is the point)
        fn = libz.crc32_z  # size_t length (zlib >= 1.2.9)
        fn.argtypes = [ctypes.c_ulong, ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ulong
    return fn


_CRC32 = _load_libz_crc32()


def crc32(data) -> int:
    """CRC-32 of a bytes-like object (bytes, memoryview, numpy array), as zlib.crc32 gives it."""
    if _CRC32 is None:
        return zlib.crc32(data) & 0xFFFFFFFF
    array = np.frombuffer(data, dtype=np.uint8)
    if array.size == 0:
        return 0
    return _CRC32(0, array.ctypes.data, array.size) & 0xFFFFFFFF


def holds_gil() -> bool:
    """True when checksums keep the GIL (libz found); False on the zlib fallback."""
    return _CRC32 is not None
