"""The pool's checksum is XXH3-64, equal to python-xxhash's own, and it keeps the GIL."""

import sys
import threading

import numpy as np
import pytest
import xxhash

from kv_transfer.pool import checksum

CHUNK = checksum.GIL_KEEPING_CHUNK


@pytest.mark.parametrize("nbytes", [0, 1, 63, CHUNK - 1, CHUNK, CHUNK + 1, 4 * CHUNK, 4 * CHUNK + 7])
def test_xxh3_equals_the_one_shot_digest_for_every_kind_of_buffer(nbytes):
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes + 16, dtype=np.uint8)
    view = memoryview(data)[8:8 + nbytes]  # a slice that does not start at the array's base
    expected = xxhash.xxh3_64_intdigest(bytes(view))
    assert checksum.xxh3_64(view) == expected
    assert checksum.xxh3_64(bytes(view)) == expected
    assert checksum.xxh3_64(data[8:8 + nbytes]) == expected


def test_xxh3_reads_read_only_and_multi_byte_buffers():
    payload = bytes(range(256)) * 64
    assert checksum.xxh3_64(memoryview(payload)) == xxhash.xxh3_64_intdigest(payload)
    pages = np.arange(4096, dtype=np.float32)  # a KV page is not a byte array
    assert checksum.xxh3_64(pages) == xxhash.xxh3_64_intdigest(pages.tobytes())


def test_a_block_sized_checksum_never_lets_another_thread_run():
    # A pool load runs beside vLLM's busy loop: any release of the GIL costs it up to a
    # switch interval to get it back. With a long interval the main thread keeps the GIL
    # unless a C call hands it over, so a counting thread advances only on a release.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.2)  # >> the ~0.4 ms the checksum takes
    counter, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            counter[0] += 1

    data = np.ones(32 * 256 * 1024, dtype=np.uint8)  # 32 blocks of 256 KiB
    thread = threading.Thread(target=count, daemon=True)
    try:
        thread.start()  # the counter runs until the interval hands the GIL back to us
        before = counter[0]
        checksum.xxh3_64(data)
        after = counter[0]
        # The control: the one-shot call lets go of the GIL. On a loaded machine the counting
        # thread may get no core during one 0.4 ms release (CI), so it gets up to 200 chances.
        control = after
        for _ in range(200):
            released = xxhash.xxh3_64_intdigest(data)
            control = counter[0]
            if control > after:
                break
    finally:
        stop.set()
        sys.setswitchinterval(previous)
        thread.join()
    assert after == before, "the checksum released the GIL"
    assert control > after, "the control did not release the GIL: this test cannot tell"
    assert released == checksum.xxh3_64(data)
