"""Reused host staging (kv_transfer/host_staging.py): buffers come back and are handed out again."""

from __future__ import annotations

import gc

from kv_transfer.host_staging import MIN_CLASS_BYTES, HostStaging


def test_a_leased_buffer_is_handed_out_again():
    staging = HostStaging(pinned=False)
    with staging.lease((2, 3, 1000)) as first:
        first_ptr = first.data_ptr()
        assert tuple(first.shape) == (2, 3, 1000)
    assert staging.kept_bytes == MIN_CLASS_BYTES
    with staging.lease((4, 100)) as second:  # same size class
        assert second.data_ptr() == first_ptr
    assert staging.kept_bytes == MIN_CLASS_BYTES


def test_views_handed_to_a_transport_return_the_buffer_when_dropped():
    staging = HostStaging(pinned=False)
    staged = staging.take((8, 1024))
    view = staging.views_until_dropped(staged)
    pages = [view[i * 1024:(i + 1) * 1024] for i in range(8)]
    del staged, view
    gc.collect()
    assert staging.kept_bytes == 0  # the pages still hold it
    del pages
    gc.collect()
    assert staging.kept_bytes == MIN_CLASS_BYTES


def test_the_bytes_kept_are_bounded():
    staging = HostStaging(pinned=False, max_kept_bytes=MIN_CLASS_BYTES)
    first, second = staging.take((MIN_CLASS_BYTES,)), staging.take((MIN_CLASS_BYTES,))
    staging.give_back(first)
    staging.give_back(second)  # over the bound: let go
    assert staging.kept_bytes == MIN_CLASS_BYTES
