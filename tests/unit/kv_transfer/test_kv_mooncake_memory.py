"""MemoryRegistry (which memory a Mooncake engine has registered) against a fake engine that
refuses overlapping ranges the way Mooncake does (rc -7); and KVPages.regions()."""

import pytest

from kv_transfer.errors import TransferFailed
from kv_transfer.transport.mooncake_memory import MemoryRegistry, buffer_address, merge_ranges


class FakeEngine:
    def __init__(self):
        self.ranges: dict[int, int] = {}  # start -> end
        self.calls: list[tuple] = []

    def register_memory(self, address: int, nbytes: int) -> int:
        self.calls.append(("register", address, nbytes))
        if any(address < end and start < address + nbytes for start, end in self.ranges.items()):
            return -7
        self.ranges[address] = address + nbytes
        return 0

    def unregister_memory(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0 if self.ranges.pop(address, None) is not None else -3


def test_merge_ranges():
    assert merge_ranges([(100, 10), (0, 50), (50, 10), (105, 20), (200, 0)]) == [(0, 60), (100, 125)]


def test_pages_inside_a_region_are_not_registered_again():
    buf = bytearray(4096)
    engine = FakeEngine()
    memory = MemoryRegistry(engine)
    base = buffer_address(memoryview(buf))
    memory.add_regions([(base, 2048), (base + 1024, 3072)])  # overlapping: merged into one
    assert engine.ranges == {base: base + 4096}
    view = memoryview(buf)[1024:2048]
    assert memory.ensure(view) == (base + 1024, base)
    assert memory.ensure(memoryview(bytes(16)))[0] != 0  # read-only buffers have addresses too
    assert [c[0] for c in engine.calls] == ["register", "register"]


def test_lone_pages_are_cached_and_stale_ones_replaced():
    buf = bytearray(8192)
    engine = FakeEngine()
    memory = MemoryRegistry(engine)
    base = buffer_address(memoryview(buf))
    assert memory.ensure(memoryview(buf)[:4096]) == (base, None)
    assert memory.ensure(memoryview(buf)[:4096]) == (base, None)
    assert engine.calls == [("register", base, 4096)]
    # A page overlapping the cached one (its memory was freed and reused): replaced.
    memory.ensure(memoryview(buf)[2048:6144])
    assert engine.ranges == {base + 2048: base + 6144}
    memory.clear()
    assert engine.ranges == {}


def test_a_page_overlapping_a_region_fails():
    buf = bytearray(8192)
    engine = FakeEngine()
    memory = MemoryRegistry(engine)
    base = buffer_address(memoryview(buf))
    memory.add_regions([(base, 4096)])
    with pytest.raises(TransferFailed, match="overlaps a registered region"):
        memory.ensure(memoryview(buf)[2048:6144])
    assert engine.ranges == {base: base + 4096}


def test_kv_pages_regions_span_each_layer():
    torch = pytest.importorskip("torch")
    from kv_transfer.kv_pages import KVPages

    buffer = torch.zeros(2, 8, 2, 4, 16, dtype=torch.bfloat16)  # [layers, blocks, heads, 2*bs, head]
    memory = KVPages({"model.layers.1.attn": buffer[1], "model.layers.0.attn": buffer[0]}).host_memory()
    layer_bytes = 8 * 2 * 4 * 16 * 2
    assert memory.regions() == [(buffer[0].data_ptr(), layer_bytes), (buffer[1].data_ptr(), layer_bytes)]
    strided = torch.zeros(8, 2, 64, dtype=torch.uint8)[:, 0]  # blocks contiguous, layer not
    assert KVPages({"layers.0": strided}).host_memory().regions() == [(strided.data_ptr(), 7 * 128 + 64)]


def test_plan_reads_merges_only_adjacent_pages_in_regions():
    from kv_transfer.transport.mooncake_client import plan_reads
    from kv_transfer.wire import PageTable

    remote = [(1000, 10), (1010, 10), (1020, 10), (5000, 10), (5010, 0), (5010, 10)]
    local = [(200, 7), (210, 7), (230, 7), (240, 7), (250, 7), (250, 7)]
    reads = plan_reads(local, PageTable(1, remote, pages_in_regions=True))
    assert (reads.local, reads.remote, reads.lengths) == ([200, 230, 240], [1000, 1020, 5000], [20, 10, 20])
    lone = plan_reads(local, PageTable(1, remote, pages_in_regions=False))  # server pages registered alone
    assert lone.lengths == [10, 10, 10, 10, 10]
    other_region = [(200, 7), (210, 9)]  # adjacent, but in two registrations
    assert plan_reads(other_region, PageTable(1, remote[:2], True)).lengths == [10, 10]
    lone_local = [(200, None), (210, None)]
    assert plan_reads(lone_local, PageTable(1, remote[:2], True)).lengths == [10, 10]
