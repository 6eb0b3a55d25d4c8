"""Pending pool stores are bounded and shed under pressure (kv_transfer/pool/store_queue.py).

A stored request's blocks stay held until its store is done. Against a pool that is slow but
not failing (each put answers within its deadline, so the breaker never opens), an unbounded
store queue used to hold ever more of the engine's KV. Now a store beyond `max_pending_stores`,
or one that waited longer than `max_store_wait_s`, is dropped and its blocks let go at once."""

import threading
import time

import pytest

from kv_transfer.connector_scheduler import StepPlan
from kv_transfer.connector_worker import WorkerSide
from kv_transfer.pool.health import PoolHealth
from kv_transfer.pool.keys import KeySpace
from kv_transfer.pool.objects import HEADER_BYTES, token_digest
from kv_transfer.pool.records import PoolBlock, PoolStoreJob
from kv_transfer.pool.worker_tier import PoolWorker
from kv_transfer.settings import ConnectorSettings
from tests.unit.kv_pool_fakes import FakePoolStore
from tests.unit.kv_transfer.test_kv_connector_worker import BLOCKS, LAYERS, PAGE_BYTES, BytePages, free_port

PUT_S = 0.3  # each put of the slow pool: well within any store deadline, so nothing "fails"


class SlowPoolStore(FakePoolStore):
    """Answers every put correctly, but slowly (a congested segment)."""

    def put_from(self, keys, addresses, sizes, pin_s: float = 0.0, replace: bool = False):
        time.sleep(PUT_S)
        return super().put_from(keys, addresses, sizes, pin_s, replace)


def store_job(index: int) -> PoolStoreJob:
    """A finished request whose only hold on its block is this store (no lease)."""
    block_hash = index.to_bytes(4, "big") * 8
    return PoolStoreJob(f"r-{index}", (PoolBlock(block_hash, token_digest([index] * 16), index % BLOCKS),),
                        holds_blocks=True)


@pytest.fixture
def slow_side():
    store = SlowPoolStore()
    pool = PoolWorker(lambda: store, KeySpace("app", "d"), 0, PoolHealth(10),
                      staging_bytes=HEADER_BYTES + LAYERS * PAGE_BYTES)
    side = WorkerSide(ConnectorSettings(port=free_port(), pool={"max_pending_stores": 4, "max_store_wait_s": 1.0}),
                      pool=pool)
    side.register(BytePages(seed=1))
    yield side, store
    side.shutdown()


def test_a_slow_pool_gives_the_blocks_back_within_a_bound_and_counts_what_it_shed(slow_side):
    side, store = slow_side
    started = time.monotonic()
    side.apply(StepPlan(pool_stores=[store_job(i) for i in range(100)]))
    # Beyond 4 pending, stores are shed in the engine's step itself: their blocks are free now.
    freed = side.results()[0]
    assert len(freed) >= 96
    while len(freed) < 100 and time.monotonic() - started < 30:
        freed |= side.results()[0]
        time.sleep(0.01)
    took_s = time.monotonic() - started
    # The 4 queued stores run one after another (4 x PUT_S) or, once older than max_store_wait_s,
    # are dropped: every block is back in about max_store_wait_s + one put, not 100 x PUT_S = 30 s.
    assert freed == {f"r-{i}" for i in range(100)}
    assert took_s < 1.0 + PUT_S + 1.0, took_s
    stats = side.stats()
    assert stats["pool_stores_shed_total"] >= 96
    assert stats["pool_stores_shed_total"] + stats["pool_stores_total"] == 100
    assert stats["pool_blocks_shed_total"] == stats["pool_stores_shed_total"]  # one block each
    assert len(store.objects) == stats["pool_stores_total"] >= 1  # what ran was stored


def test_stores_within_the_bound_all_run(slow_side):
    side, store = slow_side
    side.apply(StepPlan(pool_stores=[store_job(i) for i in range(3)]))
    assert side.results()[0] == set()  # being stored: still held
    freed: set[str] = set()
    deadline = time.monotonic() + 5
    while len(freed) < 3 and time.monotonic() < deadline:
        freed |= side.results()[0]
        time.sleep(0.01)
    assert freed == {"r-0", "r-1", "r-2"}
    assert side.stats()["pool_stores_shed_total"] == 0 and len(store.objects) == 3


# -- the queue's rules, with a clock and a gate -----------------------------------------------------


class Clock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.fixture
def gated_queue():
    from kv_transfer.pool.store_queue import StoreQueue

    gate = threading.Event()
    ran, shed = [], []
    clock = Clock()

    def run(job):
        gate.wait(5)
        ran.append(job)

    queue = StoreQueue(run, shed.append, max_pending=3, max_wait_s=5.0, clock=clock)
    yield queue, gate, ran, shed, clock
    gate.set()
    queue.shutdown(wait=True)


def test_beyond_max_pending_a_store_is_shed_at_once_and_the_running_one_counts(gated_queue):
    queue, gate, ran, shed, _ = gated_queue
    assert queue.submit("a")
    wait_until(lambda: queue.pending() == 1 and not queue._queue)  # "a" is running
    assert queue.submit("b") and queue.submit("c")
    assert not queue.submit("d")  # running + 2 queued = 3
    assert shed == ["d"]
    gate.set()
    wait_until(lambda: len(ran) == 3)
    assert ran == ["a", "b", "c"] and queue.pending() == 0


def test_a_store_that_waited_past_max_wait_s_is_shed_instead_of_run(gated_queue):
    queue, gate, ran, shed, clock = gated_queue
    queue.submit("a")
    wait_until(lambda: not queue._queue)  # "a" is running, held by the gate
    queue.submit("b")
    clock.now_s = 4.0
    queue.submit("c")
    clock.now_s = 5.5  # "b" has waited 5.5 s, "c" 1.5 s
    gate.set()
    wait_until(lambda: len(ran) + len(shed) == 3)
    assert ran == ["a", "c"] and shed == ["b"]


def test_a_new_store_sheds_the_stale_ones_ahead_of_it(gated_queue):
    queue, gate, ran, shed, clock = gated_queue
    queue.submit("a")
    wait_until(lambda: not queue._queue)
    queue.submit("b")
    queue.submit("c")
    clock.now_s = 6.0
    assert queue.submit("d")  # would be full, but "b" and "c" are stale: shed, making room
    assert shed == ["b", "c"] and queue.pending() == 2


def test_pool_settings_refuse_a_bound_that_cannot_work():
    from kv_transfer.pool.store import PoolSettings

    with pytest.raises(ValueError, match="max_pending_stores must be at least 1"):
        PoolSettings.from_dict({"max_pending_stores": 0})
    with pytest.raises(ValueError, match="max_store_wait_s must be above 0"):
        PoolSettings.from_dict({"max_store_wait_s": 0})
