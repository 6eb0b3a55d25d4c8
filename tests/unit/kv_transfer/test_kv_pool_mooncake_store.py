"""MooncakePoolStore against a real mooncake_master (subprocess on free loopback ports)."""

from __future__ import annotations

import signal
import subprocess
import time

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from cluster.kv_pool_service import MasterConfig, free_port, master_binary, port_open  # noqa: E402
from kv_transfer.pool.mooncake_shared import shared_store  # noqa: E402
from kv_transfer.pool.mooncake_store import MooncakePoolStore  # noqa: E402
from kv_transfer.pool.store import PoolSettings, PoolUnavailable  # noqa: E402

OBJ = 256 << 10  # bytes per test object
EXISTS_TIMEOUT_S = 1.0
TRANSFER_TIMEOUT_S = 2.0


def _wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until the kernel shows the process stopped (state T): SIGSTOP is asynchronous, and on a
    loaded box the master may still answer a call or two after it was sent."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


class Master:
    def __init__(self, tmp_path):
        self.config = MasterConfig("127.0.0.1", free_port(), free_port(), free_port())
        self.log = tmp_path / f"master-{self.config.rpc_port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.config.command(master_binary()), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not (port_open("127.0.0.1", self.config.rpc_port) and port_open("127.0.0.1", self.config.http_port)):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-2000:]
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def settings(self, **overrides) -> PoolSettings:
        c = self.config
        base = dict(master_address=f"127.0.0.1:{c.rpc_port}", metadata_url=f"http://127.0.0.1:{c.http_port}/metadata",
                    segment_bytes=16 << 20, local_buffer_bytes=8 << 20, retry_after_s=1.0)
        return PoolSettings(**{**base, **overrides})


@pytest.fixture
def master(tmp_path):
    """A master of the test's own (tests that kill, stop or fill it)."""
    m = Master(tmp_path)
    m.start()
    yield m
    m.kill()


@pytest.fixture(scope="module")
def shared_master(tmp_path_factory):
    """One master for tests that leave it as it was (each closes its clients, freeing segments)."""
    m = Master(tmp_path_factory.mktemp("mooncake"))
    m.start()
    yield m
    m.kill()


def new_store(settings: PoolSettings, connect: bool = True) -> MooncakePoolStore:
    store = MooncakePoolStore(settings, exists_timeout_s=EXISTS_TIMEOUT_S, transfer_timeout_s=TRANSFER_TIMEOUT_S)
    if connect:  # setup() takes 0.1-2 s on a busy box; calls would wait only their own deadline
        assert store.connect(wait_s=15)
    return store


class Buffers:
    """A source with distinct bytes per object and a zeroed sink, both registered."""

    def __init__(self, store: MooncakePoolStore, objects: int):
        self.src = (np.arange(objects * OBJ, dtype=np.uint32) * 2654435761 % 251).astype(np.uint8)
        self.dst = np.zeros_like(self.src)
        store.register_buffer(self.src.ctypes.data, self.src.nbytes)
        store.register_buffer(self.dst.ctypes.data, self.dst.nbytes)

    def src_at(self, i: int) -> int:
        return self.src.ctypes.data + i * OBJ

    def dst_at(self, i: int) -> int:
        return self.dst.ctypes.data + i * OBJ

    def same(self, src_i: int, dst_i: int) -> bool:
        return bytes(self.src[src_i * OBJ:(src_i + 1) * OBJ]) == bytes(self.dst[dst_i * OBJ:(dst_i + 1) * OBJ])


def wait_usable(store: MooncakePoolStore, timeout_s: float) -> float:
    started = time.monotonic()
    while True:
        try:
            store.exists(["probe"])
            return time.monotonic() - started
        except PoolUnavailable:
            assert time.monotonic() - started < timeout_s, store.stats()
            time.sleep(0.2)


def test_puts_land_in_the_writers_own_segment_until_it_is_full(shared_master):
    """A read from a client's own segment is a local copy (2.5-3x faster than a remote one on
    TCP): objects go where their writer is; a writer with no segment writes into another's, and
    a full segment sends puts elsewhere instead of refusing them."""
    first, second = new_store(shared_master.settings()), new_store(shared_master.settings())
    lookup_only = MooncakePoolStore(shared_master.settings(segment_bytes=0), exists_timeout_s=EXISTS_TIMEOUT_S,
                                    transfer_timeout_s=TRANSFER_TIMEOUT_S)
    assert lookup_only.connect(wait_s=15)
    try:
        mine, theirs = first.own_segment(), second.own_segment()
        assert mine and theirs and mine != theirs and lookup_only.own_segment() is None
        for writer, prefix, expected in ((first, "first", {mine}), (second, "second", {theirs})):
            buf = Buffers(writer, 4)
            keys = [f"{prefix}-{i}" for i in range(4)]
            assert writer.put_from(keys, [buf.src_at(i) for i in range(4)], [OBJ] * 4) == [True] * 4
            assert set(first.segments_of(keys)) == expected, prefix
        buf = Buffers(lookup_only, 4)
        keys = [f"nowhere-{i}" for i in range(4)]
        assert lookup_only.put_from(keys, [buf.src_at(i) for i in range(4)], [OBJ] * 4) == [True] * 4
        assert set(lookup_only.segments_of(keys)) <= {mine, theirs}
        # More than the 16 MiB segment holds: all stored, the overflow in the other segment.
        buf = Buffers(first, 1)
        keys = [f"overflow-{i}" for i in range(72)]
        assert first.put_from(keys, [buf.src_at(0)] * 72, [OBJ] * 72) == [True] * 72
        placed = first.segments_of(keys)
        assert placed[0] == mine and placed.count(theirs) > 0 and None not in placed, placed
    finally:
        for store in (first, second, lookup_only):
            store.close()


def test_round_trip_missing_and_idempotent_put(shared_master):
    store = new_store(shared_master.settings())
    try:
        buf = Buffers(store, 4)
        keys = ["a", "b", "c"]
        assert store.exists(keys) == [False, False, False]
        assert store.put_from(keys, [buf.src_at(i) for i in range(3)], [OBJ] * 3) == [True] * 3
        assert store.exists(keys + ["missing"]) == [True, True, True, False]
        got = store.get_into(["c", "a", "missing"], [buf.dst_at(i) for i in range(3)], [OBJ] * 3)
        assert got[:2] == [OBJ, OBJ] and got[2] < 0
        assert buf.same(2, 0) and buf.same(0, 1)
        # Immutable objects: a second put of a key counts as stored and keeps the first bytes.
        assert store.put_from(["a"], [buf.src_at(3)], [OBJ]) == [True]
        assert store.get_into(["a"], [buf.dst_at(3)], [OBJ]) == [OBJ]
        assert buf.same(0, 3)
        # Removed (a corrupt object): gone, and the next put writes it afresh.
        store.remove(["a", "missing"])
        assert store.exists(["a", "b"]) == [False, True]
        assert store.put_from(["a"], [buf.src_at(3)], [OBJ]) == [True]
        assert store.get_into(["a"], [buf.dst_at(2)], [OBJ]) == [OBJ] and buf.same(3, 2)
        assert store.exists([]) == [] and store.put_from([], [], []) == [] and store.get_into([], [], []) == []
        assert store.stats()["segment_bytes"] == 16 << 20
    finally:
        store.close()
    with pytest.raises(PoolUnavailable):  # never touches a closed client (that would segfault)
        store.exists(["a"])


def test_full_pool_refuses_puts(master):
    store = new_store(master.settings())
    try:
        buf = Buffers(store, 1)
        keys = [f"full-{i}" for i in range(80)]  # 20 MiB into a 16 MiB pool, one batch
        stored = store.put_from(keys, [buf.src_at(0)] * len(keys), [OBJ] * len(keys))
        assert 0 < sum(stored) < len(keys)
        assert store.exists(keys) == stored
    finally:
        store.close()


def test_segment_below_mooncake_minimum_is_a_config_error():
    with pytest.raises(ValueError, match="16 MiB"):
        MooncakePoolStore(PoolSettings(master_address="127.0.0.1:1", segment_bytes=4 << 20))


def test_no_master_fails_fast_and_waits_retry_after(tmp_path):
    settings = Master(tmp_path).settings(retry_after_s=30.0)  # ports nobody listens on
    store = new_store(settings, connect=False)
    started = time.monotonic()
    with pytest.raises(PoolUnavailable):
        store.exists(["a"])
    with pytest.raises(PoolUnavailable, match="retrying later"):
        store.exists(["a"])
    assert time.monotonic() - started < 1.5
    store.close()


def test_master_killed_then_restarted(master):
    store = new_store(master.settings())
    try:
        buf = Buffers(store, 2)
        assert store.put_from(["k"], [buf.src_at(0)], [OBJ]) == [True]
        master.kill()
        for call, bound_s in ((lambda: store.exists(["k"]), EXISTS_TIMEOUT_S),
                              (lambda: store.get_into(["k"], [buf.dst_at(0)], [OBJ]), TRANSFER_TIMEOUT_S),
                              (lambda: store.put_from(["k2"], [buf.src_at(1)], [OBJ]), TRANSFER_TIMEOUT_S)):
            started = time.monotonic()
            with pytest.raises(PoolUnavailable):
                call()
            assert time.monotonic() - started < bound_s + 0.5
        master.start()  # same ports; the client reconnects and re-mounts its segment by itself
        wait_usable(store, timeout_s=10)
        assert store.exists(["k"]) == [False]  # the master's state died with it
        deadline = time.monotonic() + 5
        while store.put_from(["k2"], [buf.src_at(1)], [OBJ]) != [True]:  # -200 until re-mounted
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert store.get_into(["k2"], [buf.dst_at(1)], [OBJ]) == [OBJ] and buf.same(1, 1)
        assert store.stats()["reconnects_total"] == 0
    finally:
        store.close()


def test_hung_master_is_bounded_then_recovers(master):
    store = new_store(master.settings())
    try:
        assert store.exists(["a"]) == [False]
        master.proc.send_signal(signal.SIGSTOP)  # the client would block 30 s per call
        # A call already answered by the master's socket buffers may still return once on a
        # loaded box; within a few calls one must time out, each bounded by its deadline.
        _wait_stopped(master.proc.pid)
        for attempt in range(5):
            started = time.monotonic()
            try:
                store.exists(["a"])
            except PoolUnavailable as exc:
                assert "took over" in str(exc)
                break
            finally:
                assert time.monotonic() - started < EXISTS_TIMEOUT_S + 0.5
        else:
            pytest.fail("no call timed out against a stopped master")
        started = time.monotonic()
        with pytest.raises(PoolUnavailable, match="overdue"):  # no second wait behind the stuck call
            store.exists(["a"])
        assert time.monotonic() - started < 0.1
        master.proc.send_signal(signal.SIGCONT)
        wait_usable(store, timeout_s=5)
        assert store.stats()["timeouts_total"] == 1
    finally:
        store.close()


def test_reconnect_replaces_client_and_registers_buffers_again(shared_master):
    store = new_store(shared_master.settings())
    try:
        buf = Buffers(store, 1)
        assert store.put_from(["r"], [buf.src_at(0)], [OBJ]) == [True]
        store.reconnect()  # the old client (and its segment, with "r") goes away
        wait_usable(store, timeout_s=5)
        assert store.put_from(["r2"], [buf.src_at(0)], [OBJ]) == [True]
        assert store.get_into(["r2"], [buf.dst_at(0)], [OBJ]) == [OBJ] and buf.same(0, 0)
        assert store.stats()["reconnects_total"] == 1
    finally:
        store.close()


def test_shared_store_one_client_per_master_and_prefix(shared_master):
    lookup = shared_store(shared_master.settings(key_prefix="app1"), lookup_only=True)
    try:
        assert lookup.connect(wait_s=15) and lookup.stats()["segment_bytes"] == 0  # lookup-only works
        other = shared_store(shared_master.settings(key_prefix="app2"))
        assert other is not lookup
        other.close()
        assert shared_store(shared_master.settings(key_prefix="app2")) is not other  # a closed one is replaced
        shared_store(shared_master.settings(key_prefix="app2")).close()
        # A second caller (the worker) wants a segment: the shared client mounts one.
        assert shared_store(shared_master.settings(key_prefix="app1")) is lookup
        deadline = time.monotonic() + 5
        while lookup.stats()["segment_bytes"] != 16 << 20:
            lookup.exists(["x"])
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        lookup.close()
