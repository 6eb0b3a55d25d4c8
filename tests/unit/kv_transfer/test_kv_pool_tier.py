"""The KV pool tier of our connector, with an in-memory store behind the real interface:
objects and their verification, lookups after the local hit, what is stored at the end of a
request, loads and stores through the worker, and the blocks' release waiting for a store.
The same logic runs against a real Mooncake master in tests/integration/test_kv_pool_stack.py."""

import time

import pytest

from kv_transfer.connector_scheduler import SchedulerSide
from kv_transfer.pool.health import PoolHealth
from kv_transfer.pool.keys import KeySpace
from kv_transfer.pool.objects import (HEADER_BYTES, BlockLayout, CorruptObject, encode_header, payload_checksum,
                                      token_digest, verify)
from kv_transfer.pool.records import PoolBlock, PoolStoreJob
from kv_transfer.pool.scheduler_tier import PoolScheduler
from kv_transfer.pool.store import PoolUnavailable
from kv_transfer.pool.worker_tier import PoolLoadFailed, PoolWorker
from kv_transfer.params import TransferParams
from kv_transfer.settings import ConnectorSettings
from tests.unit.kv_grant_fakes import SECRET, signed
from tests.unit.kv_pool_fakes import FakePoolStore, PoolRequest, chained_hashes
from tests.unit.kv_transfer.test_kv_connector_worker import LAYERS, PAGE_BYTES, BytePages

BS = 16
KEYS = KeySpace("app", "digest0")


class Clock:
    def __init__(self):
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def request(request_id="r-1", prompt_len=70, **kw) -> PoolRequest:
    tokens = [(7 * i + 3) % 500 for i in range(prompt_len)]
    return PoolRequest(request_id, tokens, chained_hashes(tokens, BS), **kw)


def pooled(store: FakePoolStore, req: PoolRequest, blocks: range, keys: KeySpace = KEYS) -> None:
    for index in blocks:
        for key in keys.keys_all_ranks(req.block_hashes[index]):
            store.objects[key] = b"x"


@pytest.fixture
def store():
    return FakePoolStore()


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def tier(store, clock):
    return PoolScheduler(lambda: store, KEYS, BS, PoolHealth(retry_after_s=10), clock)


# -- objects -------------------------------------------------------------------------------------

LAYOUT = BlockLayout(num_layers=2, page_bytes=32)


def make_object(key="k", tokens=(1, 2, 3), payload=bytes(range(64))) -> bytearray:
    header = encode_header(key, token_digest(tokens), LAYOUT, payload_checksum(payload))
    return bytearray(header + payload)


def test_an_object_verifies_against_its_key_tokens_and_layout():
    obj = make_object()
    assert len(obj) == LAYOUT.object_bytes == HEADER_BYTES + 64
    assert bytes(verify(memoryview(obj), "k", token_digest((1, 2, 3)), LAYOUT)) == bytes(range(64))


@pytest.mark.parametrize("damage, message", [
    (lambda o: o.__setitem__(slice(0, 4), b"XXXX"), "not a moe-serve KV object"),
    (lambda o: o.__setitem__(HEADER_BYTES + 5, o[HEADER_BYTES + 5] ^ 1), "checksum"),
    (lambda o: o.__delitem__(slice(-1, None)), "bytes, expected"),
])
def test_damaged_objects_are_refused(damage, message):
    obj = make_object()
    damage(obj)
    with pytest.raises(CorruptObject, match=message):
        verify(memoryview(obj), "k", token_digest((1, 2, 3)), LAYOUT)


def test_an_object_for_another_key_tokens_or_layout_is_refused():
    obj = memoryview(make_object())
    with pytest.raises(CorruptObject, match="another key"):
        verify(obj, "other", token_digest((1, 2, 3)), LAYOUT)
    with pytest.raises(CorruptObject, match="other token ids"):
        verify(obj, "k", token_digest((1, 2, 4)), LAYOUT)
    with pytest.raises(CorruptObject, match="layout"):
        verify(obj, "k", token_digest((1, 2, 3)), BlockLayout(num_layers=4, page_bytes=16))


# -- lookups ------------------------------------------------------------------------------------

def test_lookup_finds_the_run_of_pool_blocks_after_the_local_hit(tier, store):
    req = request(prompt_len=70)  # 4 full blocks (64 tokens) + 6
    pooled(store, req, range(0, 3))
    assert tier.lookup(req, local_tokens=16) == 2  # blocks 1 and 2; block 3 is missing
    assert tier.take_hit(req.request_id) == (1, 2)
    assert tier.take_tally().blocks_hit == 2


def test_lookup_stops_at_the_first_missing_block(tier, store):
    req = request(prompt_len=70)
    pooled(store, req, range(1, 4))  # block 0 missing: the later ones are useless
    assert tier.lookup(req, 0) == 0
    assert tier.take_hit(req.request_id) == (0, 0)


def test_a_block_counts_only_when_every_tensor_parallel_rank_holds_it(store, clock):
    keys = KeySpace("app", "digest0", tp_size=2)
    tier = PoolScheduler(lambda: store, keys, BS, PoolHealth(10), clock)
    req = request(prompt_len=64)
    pooled(store, req, range(0, 4), keys)
    del store.objects[keys.key(req.block_hashes[2], 1)]
    assert tier.lookup(req, 0) == 2


def test_lookup_never_reaches_past_the_prompt_or_into_a_partial_block(tier, store):
    req = request(prompt_len=40)  # two full blocks
    pooled(store, req, range(0, 2))
    req.block_hashes.append(b"beyond-the-prompt")
    assert tier.lookup(req, 0) == 2
    assert tier.lookup(req, 32) == 0  # nothing left to look up: no call
    assert store.calls == ["exists"]


def test_a_down_pool_is_skipped_until_retry_after_then_tried_again(tier, store, clock):
    req = request(prompt_len=64)
    pooled(store, req, range(0, 4))
    store.down = True
    assert tier.lookup(req, 0) == 0
    assert tier.lookup(req, 0) == 0
    assert store.calls == ["exists"]  # the breaker is open: one failed call, not one per request
    store.down = False
    clock.now_s += 10
    assert tier.lookup(req, 0) == 4
    assert tier.take_tally().failures == 1


# -- stores ---------------------------------------------------------------------------------------

def test_store_offers_every_computed_full_block_but_those_loaded_from_the_pool(tier):
    req = request(prompt_len=70, num_computed_tokens=70 + 29)  # prompt + 30 generated, the last not computed
    req.output_token_ids = list(range(30))
    req.block_hashes = chained_hashes(req.all_token_ids, BS)  # vLLM extends them as tokens arrive
    tier.loaded(req.request_id, first_block=1, blocks=2)
    job = tier.store_job(req, block_ids=list(range(100, 107)), holds_blocks=True)
    assert [b.block_id for b in job.blocks] == [100, 103, 104, 105]  # 99 tokens: 6 full blocks, 1-2 pooled
    assert job.blocks[0].block_hash == req.block_hashes[0]
    assert job.blocks[1].token_digest == token_digest(req.all_token_ids[48:64])
    assert job.holds_blocks


def test_blocks_whose_pool_load_failed_are_recomputed_and_stored_again(tier):
    """The worker dropped the bad objects and the engine recomputed them: unless they are stored
    again, the pool lacks them until some later request happens to compute them."""
    req = request(prompt_len=64, num_computed_tokens=64)
    tier.loaded(req.request_id, first_block=0, blocks=3)
    tier.load_failed(req.request_id)
    job = tier.store_job(req, block_ids=[10, 11, 12, 13], holds_blocks=True)
    assert [b.block_id for b in job.blocks] == [10, 11, 12, 13]


def test_no_store_while_the_pool_is_down(tier, store, clock):
    req = request(prompt_len=64, num_computed_tokens=64)
    store.down = True
    tier.lookup(req, 0)
    assert tier.store_job(req, [1, 2, 3, 4], holds_blocks=True) is None


# -- the scheduler side with a pool ----------------------------------------------------------------

SETTINGS = ConnectorSettings(host="10.0.0.7", port=47001, engine_id="e", lease_s=8.0, grant_secret=SECRET)


def remote(block_ids, num_tokens) -> TransferParams:
    """A prefill engine's lease, signed as it signs it (decode pulls only what verifies)."""
    return signed(TransferParams("10.0.0.7", 47001, "p", "p-1", tuple(block_ids), num_tokens, BS, time.time() + 8))


def test_colocated_request_loads_its_pool_hit_asynchronously(tier, store):
    side = SchedulerSide(SETTINGS, BS, pool=tier)
    req = request(prompt_len=70)
    pooled(store, req, range(0, 4))
    assert side.num_new_matched_tokens(req, 0) == (64, True)
    side.after_alloc(req, [5, 6, 7, 8, 9], 64)
    (job,) = side.take_plan().pulls
    assert job.params is None and job.local_block_ids == ()
    assert [b.block_id for b in job.pool_blocks] == [5, 6, 7, 8]


def test_decode_takes_the_prefix_from_the_pool_and_only_the_rest_from_the_lease(tier, store):
    side = SchedulerSide(SETTINGS, BS, pool=tier)
    transfer = remote([11, 12, 13, 14, 15], num_tokens=70)
    req = request("d-1", prompt_len=70, kv_transfer_params=transfer.to_engine())
    pooled(store, req, range(0, 3))
    assert side.num_new_matched_tokens(req, 16) == (54, True)  # block 0 is a local hit
    side.after_alloc(req, [21, 22, 23, 24], 54)
    (job,) = side.take_plan().pulls
    assert [b.block_id for b in job.pool_blocks] == [21, 22]  # blocks 1, 2 from the pool
    assert job.local_block_ids == (23, 24) and job.remote_block_ids == (14, 15)  # 3, 4 from the lease


def test_decode_whose_lease_is_all_in_the_pool_still_releases_the_lease(tier, store):
    side = SchedulerSide(SETTINGS, BS, pool=tier)
    transfer = remote([11, 12], num_tokens=32)
    req = request("d-1", prompt_len=32, kv_transfer_params=transfer.to_engine())
    pooled(store, req, range(0, 2))
    assert side.num_new_matched_tokens(req, 0) == (32, True)
    side.after_alloc(req, [21, 22], 32)
    (job,) = side.take_plan().pulls
    assert job.local_block_ids == () and len(job.pool_blocks) == 2 and job.params == transfer


def test_a_finished_request_delays_its_free_for_the_store(tier, store):
    side = SchedulerSide(SETTINGS, BS, pool=tier)
    req = request(prompt_len=40, num_computed_tokens=40)
    assert side.finished(req, [1, 2, 3], normally=True) == (True, None)
    (job,) = side.take_plan().pool_stores
    assert job.holds_blocks and [b.block_id for b in job.blocks] == [1, 2]
    aborted = request("r-2", prompt_len=40, num_computed_tokens=40)
    assert side.finished(aborted, [4, 5, 6], normally=False) == (False, None)
    assert not side.take_plan().pool_stores


# -- worker: loads and stores through the store ------------------------------------------------------

def worker(store) -> PoolWorker:
    return PoolWorker(lambda: store, KEYS, 0, PoolHealth(10), staging_bytes=3 * (HEADER_BYTES + LAYERS * PAGE_BYTES))


def blocks_of(req: PoolRequest, block_ids: list[int]) -> list[PoolBlock]:
    return [PoolBlock(req.block_hashes[i], token_digest(req.all_token_ids[i * BS:(i + 1) * BS]), b)
            for i, b in enumerate(block_ids)]


def test_blocks_stored_by_one_engine_load_byte_for_byte_into_another(store):
    source, dest = BytePages(seed=1), BytePages()
    writer, reader = worker(store), worker(store)
    writer.attach(source)
    reader.attach(dest)
    req = request(prompt_len=80)  # 5 blocks: two staging chunks of 3
    assert writer.store(blocks_of(req, [3, 4, 5, 6, 7])) == 5
    assert writer.store(blocks_of(req, [3, 4, 5, 6, 7])) == 0  # already pooled: not written again
    reader.load(blocks_of(req, [10, 11, 12, 13, 14]))
    assert [dest.block(b) for b in (10, 11, 12, 13, 14)] == [source.block(b) for b in (3, 4, 5, 6, 7)]
    counts = reader.snapshot()
    assert counts["pool_blocks_loaded_total"] == 5 and counts["pool_bytes_loaded_total"] == 5 * LAYERS * PAGE_BYTES
    assert writer.snapshot()["pool_blocks_already_pooled_total"] == 5


def test_blocks_read_from_the_disk_tier_are_counted_as_such():
    from tests.unit.kv_pool_fakes import FakePoolStore

    store = FakePoolStore(disk_tier=True)
    source, dest = BytePages(seed=4), BytePages()
    writer, reader = worker(store), worker(store)
    writer.attach(source)
    reader.attach(dest)
    req = request(prompt_len=80)
    writer.store(blocks_of(req, [3, 4, 5, 6, 7]))
    store.on_disk = set(list(store.objects)[:2])  # the master demoted the two oldest
    loaded = reader.load(blocks_of(req, [10, 11, 12, 13, 14]))
    assert [dest.block(b) for b in (10, 11, 12, 13, 14)] == [source.block(b) for b in (3, 4, 5, 6, 7)]
    # What this load read from disk (the request's pool_disk_load phase), beside the counters.
    assert loaded.nbytes == 5 * LAYERS * PAGE_BYTES and loaded.disk_blocks == 2 and loaded.disk_s > 0
    counts = reader.snapshot()
    assert counts["pool_blocks_loaded_total"] == 5 and counts["pool_disk_blocks_loaded_total"] == 2
    assert counts["pool_disk_bytes_loaded_total"] == 2 * LAYERS * PAGE_BYTES
    assert counts["pool_disk_load_seconds_total"] > 0
    # A store without a disk tier is never asked where objects are (one master call saved).
    dram_only = FakePoolStore()
    dram_only.objects = dict(store.objects)
    plain = worker(dram_only)
    plain.attach(BytePages())
    assert plain.load(blocks_of(req, [10, 11, 12, 13, 14])).disk_blocks == 0
    assert "get_into" in dram_only.calls and "tiers_of" not in dram_only.calls
    assert plain.snapshot()["pool_disk_blocks_loaded_total"] == 0


def test_a_corrupt_or_foreign_object_fails_the_load(store):
    source = BytePages(seed=2)
    writer, reader = worker(store), worker(store)
    writer.attach(source)
    reader.attach(BytePages())
    req = request(prompt_len=32)
    writer.store(blocks_of(req, [0, 1]))
    key = KEYS.key(req.block_hashes[1], 0)
    damaged = bytearray(store.objects[key])
    damaged[-1] ^= 0xFF
    store.objects[key] = bytes(damaged)
    with pytest.raises(CorruptObject):
        reader.load(blocks_of(req, [4, 5]))
    other = request(prompt_len=32)
    other.prompt_token_ids = [t + 1 for t in other.prompt_token_ids]  # same keys, other tokens
    with pytest.raises(CorruptObject, match="other token ids"):
        reader.load(blocks_of(other, [4]))
    assert reader.snapshot()["pool_corrupt_objects_total"] == 2
    # Both corrupt objects were removed: the next store writes them afresh, and they load.
    assert key not in store.objects and KEYS.key(req.block_hashes[0], 0) not in store.objects
    assert writer.store(blocks_of(req, [0, 1])) == 2
    reader.load(blocks_of(req, [4, 5]))


def test_a_corrupt_object_takes_the_objects_after_it_out_of_the_pool(store):
    """The request recomputes from the first bad block on, and its store only writes blocks
    the pool does not hold: every object from there on must go, or a later corrupt one would
    fail the next load again (chunks of 3 blocks: the removal reaches past the chunk)."""
    writer, reader = worker(store), worker(store)
    writer.attach(BytePages(seed=6))
    reader.attach(BytePages())
    req = request(prompt_len=96)
    assert writer.store(blocks_of(req, range(6))) == 6
    key = KEYS.key(req.block_hashes[1], 0)
    store.objects[key] = store.objects[key][:-1] + bytes([store.objects[key][-1] ^ 1])
    with pytest.raises(CorruptObject):
        reader.load(blocks_of(req, range(10, 16)))
    assert sorted(store.objects) == [KEYS.key(req.block_hashes[0], 0)]


def test_a_missing_object_or_a_down_pool_fails_the_load_and_stores_give_up_quietly(store):
    reader = worker(store)
    reader.attach(BytePages())
    req = request(prompt_len=32)
    with pytest.raises(PoolLoadFailed, match="missing"):
        reader.load(blocks_of(req, [0]))
    store.down = True
    with pytest.raises(PoolUnavailable):
        reader.load(blocks_of(req, [0]))
    assert reader.store(blocks_of(req, [0])) == 0
    snap = reader.snapshot()
    assert snap["pool_up"] == 0 and snap["pool_load_failures_total"] == 2


def test_a_full_pool_refuses_and_is_counted(store):
    store.capacity = 1
    writer = worker(store)
    writer.attach(BytePages(seed=3))
    assert writer.store(blocks_of(request(prompt_len=48), [0, 1, 2])) == 1
    assert writer.snapshot()["pool_blocks_refused_total"] == 2


def test_the_release_of_a_stored_request_waits_for_its_store(store, monkeypatch):
    import threading

    from kv_transfer.connector_scheduler import StepPlan
    from kv_transfer.connector_worker import WorkerSide

    gate = threading.Event()
    pool = worker(store)
    real_store = pool.store
    monkeypatch.setattr(pool, "store", lambda blocks, **kw: (gate.wait(5), real_store(blocks, **kw))[1])
    from tests.unit.kv_transfer.test_kv_connector_worker import free_port

    side = WorkerSide(ConnectorSettings(port=free_port()), pool=pool)
    try:
        side.register(BytePages(seed=4))
        req = request(prompt_len=32, num_computed_tokens=32)
        side.apply(StepPlan(pool_stores=[PoolStoreJob(req.request_id, tuple(blocks_of(req, [0, 1])), True)]))
        assert side.results()[0] == set()  # still being stored: the blocks stay held
        gate.set()
        deadline = time.monotonic() + 5
        sending: set = set()
        while not sending and time.monotonic() < deadline:
            sending = side.results()[0]
            time.sleep(0.01)
        assert sending == {req.request_id}
        assert len(store.objects) == 2
    finally:
        side.shutdown()


def test_a_request_waiting_for_blocks_is_not_looked_up_again_within_reuse_s(tier, store, clock):
    """vLLM asks at every step while the request waits: one pool call per second at most."""
    req = request(prompt_len=70)
    pooled(store, req, range(0, 3))
    assert [tier.lookup(req, 0) for _ in range(5)] == [3] * 5
    assert store.calls == ["exists"]
    assert tier.take_hit(req.request_id) == (0, 3)
    pooled(store, req, range(3, 4))
    clock.now_s += 1.0  # stale now: asked again, and the newly pooled block is found
    assert tier.lookup(req, 0) == 4 and store.calls == ["exists", "exists"]
    assert tier.lookup(req, 16) == 3 and len(store.calls) == 3  # other blocks wanted: asked again
    tier.forget(req.request_id)
    assert tier.lookup(req, 16) == 3 and len(store.calls) == 4  # a finished request is forgotten
    assert tier.take_tally().lookups == len(store.calls) == 4  # reused answers are not pool lookups
