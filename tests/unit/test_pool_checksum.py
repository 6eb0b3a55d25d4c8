"""The pool's CRC-32 keeps the GIL (libz through ctypes.PyDLL) and equals zlib.crc32."""

import zlib

import numpy as np
import pytest

from kv_transfer.pool import checksum


@pytest.mark.parametrize("nbytes", [0, 1, 63, 5 * 1024 + 1, 256 * 1024])
def test_crc32_equals_zlib_for_every_kind_of_buffer(nbytes):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes + 16, dtype=np.uint8)
    view = memoryview(data)[8:8 + nbytes]  # a slice that does not start at the array's base
    expected = zlib.crc32(bytes(view)) & 0xFFFFFFFF
    assert checksum.crc32(view) == expected
    assert checksum.crc32(bytes(view)) == expected
    assert checksum.crc32(data[8:8 + nbytes]) == expected


def test_crc32_reads_read_only_buffers():
    payload = bytes(range(256)) * 64
    assert checksum.crc32(memoryview(payload)) == zlib.crc32(payload)


def test_libz_is_found_here_so_loads_make_no_gil_hand_off_per_block():
    # Every machine this project runs on has libz.so.1 (Python's zlib module links it); the
    # fallback exists for others. If this fails, pool loads on a busy engine are ~2x slower.
    assert checksum.holds_gil()


def test_the_fallback_gives_the_same_values(monkeypatch):
    payload = np.arange(4096, dtype=np.uint8).tobytes()
    expected = checksum.crc32(payload)
    monkeypatch.setattr(checksum, "_CRC32", None)
    assert not checksum.holds_gil()
    assert checksum.crc32(payload) == expected
