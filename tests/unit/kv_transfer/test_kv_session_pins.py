"""Session retention in the KV pool: which objects a session's store pins, when a held object's
pin is renewed, the engine's pin budget, and the path from X-Session-Id to the worker's puts
(scheduler job, worker, fake store behind the real interface). Against a real Mooncake master:
tests/unit/kv_transfer/test_kv_pool_disk_tier.py (pinned objects stay in DRAM while others are demoted)."""

from kv_transfer.params import SESSION_KEY, in_session
from kv_transfer.pool.health import PoolHealth
from kv_transfer.pool.objects import HEADER_BYTES
from kv_transfer.pool.scheduler_tier import PoolScheduler
from kv_transfer.pool.session_pins import SessionPins
from kv_transfer.pool.worker_tier import PoolWorker
from tests.unit.kv_pool_fakes import FakePoolStore
from tests.unit.kv_transfer.test_kv_connector_worker import LAYERS, PAGE_BYTES, BytePages
from tests.unit.kv_transfer.test_kv_pool_tier import BS, KEYS, Clock, blocks_of, pooled, request

OBJ = HEADER_BYTES + LAYERS * PAGE_BYTES


# -- the policy --------------------------------------------------------------------------------------

def test_new_objects_are_pinned_while_the_budget_has_room_and_pins_expire():
    pins = SessionPins(pin_s=60.0, budget_bytes=3 * 100)
    plan = pins.plan(["a", "b", "c", "d"], [], 100, now_s=0.0)
    assert plan.pin_new == (True, True, True, False) and plan.renew == ()
    pins.pinned(["a", "b", "c"], 100, now_s=0.0)
    assert pins.live_bytes == 300
    assert pins.plan(["d"], [], 100, now_s=59.0).pin_new == (False,)  # still full
    assert pins.plan(["d"], [], 100, now_s=60.0).pin_new == (True,)  # all three expired
    assert pins.live_bytes == 0


def test_a_held_pin_is_renewed_only_in_the_second_half_of_its_window():
    pins = SessionPins(pin_s=60.0, budget_bytes=10 * 100)
    pins.pinned(["a"], 100, now_s=0.0)
    assert pins.plan([], ["a"], 100, now_s=29.0).renew == (False,)  # more than half left: no rewrite
    assert pins.plan([], ["a"], 100, now_s=31.0).renew == (True,)
    pins.pinned(["a"], 100, now_s=31.0)
    assert pins.live_bytes == 100  # renewed, not counted twice
    assert pins.plan([], ["a"], 100, now_s=60.0).renew == (False,)  # the renewed pin runs to 91 s


def test_a_pin_another_engine_set_is_renewed_once_here_then_known():
    pins = SessionPins(pin_s=60.0, budget_bytes=10 * 100)
    assert pins.plan([], ["theirs"], 100, now_s=0.0).renew == (True,)
    pins.pinned(["theirs"], 100, now_s=0.0)
    assert pins.plan([], ["theirs"], 100, now_s=10.0).renew == (False,)


def test_renewals_take_the_budget_before_new_objects():
    pins = SessionPins(pin_s=60.0, budget_bytes=2 * 100)
    plan = pins.plan(["new"], ["old1", "old2"], 100, now_s=0.0)
    assert plan.renew == (True, True) and plan.pin_new == (False,)
    none = SessionPins(pin_s=60.0, budget_bytes=0).plan(["x"], ["y"], 100, now_s=0.0)
    assert none.pin_new == (False,) and none.renew == (False,)  # a prefill with no segment pins nothing


# -- from the request to the worker ----------------------------------------------------------------

def test_the_session_flag_reaches_the_engine_only_from_our_engine_server():
    from deployments.engine.vllm_engine import engine_transfer_params
    from deployments.records import EngineRequest, SamplingSpec

    plain = EngineRequest("r", [1, 2, 3], SamplingSpec(max_tokens=2))
    assert engine_transfer_params(plain) is None  # nothing to say: the engine's own defaults
    session = EngineRequest("r", [1, 2, 3], SamplingSpec(max_tokens=2), session_id="chat-1")
    assert engine_transfer_params(session) == {SESSION_KEY: True}
    prefill = EngineRequest("r", [1, 2, 3], SamplingSpec(max_tokens=2), session_id="chat-1", produce_kv=True)
    assert in_session(engine_transfer_params(prefill)) and engine_transfer_params(prefill)["do_remote_decode"]
    assert not in_session({SESSION_KEY: "yes"}) and not in_session(None)


def test_a_session_store_job_names_its_reused_history_for_renewal():
    store = FakePoolStore()
    tier = PoolScheduler(lambda: store, KEYS, BS, PoolHealth(10), Clock(), sessions=True)
    # One block in the engine's own prefix cache, two more loaded from the pool, one computed.
    req = request(prompt_len=70, num_computed_tokens=70, kv_transfer_params={SESSION_KEY: True})
    pooled(store, req, range(3))
    assert tier.lookup(req, BS) == 2
    tier.loaded(req.request_id, 1, 2)
    job = tier.store_job(req, [10, 11, 12, 13], holds_blocks=True)
    assert job.session and job.history_blocks == 3 and [b.block_id for b in job.blocks] == [10, 11, 12, 13]
    # History found in the engine's prefix cache alone is history too.
    cached = request("r-3", prompt_len=70, num_computed_tokens=70, kv_transfer_params={SESSION_KEY: True})
    tier.lookup(cached, 2 * BS)
    job = tier.store_job(cached, [10, 11, 12, 13], holds_blocks=True)
    assert job.session and job.history_blocks == 2
    # Without a session (or with retention off) the loaded blocks are not offered again.
    other = request("r-2", prompt_len=70, num_computed_tokens=70)
    tier.loaded(other.request_id, 0, 2)
    job = tier.store_job(other, [10, 11, 12, 13], holds_blocks=True)
    assert not job.session and job.history_blocks == 0 and [b.block_id for b in job.blocks] == [12, 13]
    off = PoolScheduler(lambda: store, KEYS, BS, PoolHealth(10), Clock())
    off.loaded(req.request_id, 0, 2)
    job = off.store_job(req, [10, 11, 12, 13], holds_blocks=True)
    assert not job.session and [b.block_id for b in job.blocks] == [12, 13]


def _worker(store, clock, budget_objects=100, pin_s=60.0):
    pins = SessionPins(pin_s, budget_objects * OBJ)
    w = PoolWorker(lambda: store, KEYS, 0, PoolHealth(10), staging_bytes=3 * OBJ, clock=clock, pins=pins)
    w.attach(BytePages(seed=5))
    return w


def test_a_session_store_pins_new_objects_and_renews_its_history_when_due():
    store, clock = FakePoolStore(), Clock()
    engine = _worker(store, clock)
    req = request(prompt_len=80)
    assert engine.store(blocks_of(req, [0, 1, 2]), session=True) == 3
    keys = [KEYS.key(h, 0) for h in req.block_hashes]
    assert store.pins == {k: 60.0 for k in keys[:3]} and not store.upserts
    # The next turn, soon after: its history's pins have most of their window left.
    assert engine.store(blocks_of(req, [0, 1, 2, 3, 4]), session=True) == 2
    assert not store.upserts and set(store.pins) == set(keys)
    # A turn after half the window: its reused history is rewritten pinned (upsert), once.
    clock.now_s += 31
    engine.store(blocks_of(req, [0, 1, 2, 3, 4]), session=True, history_blocks=4)
    assert sorted(store.upserts) == sorted(keys[:4])
    engine.store(blocks_of(req, [0, 1, 2, 3, 4]), session=True, history_blocks=5)
    assert sorted(store.upserts) == sorted(keys)  # the fifth is due too; the four renewed are not
    counts = engine.snapshot()
    assert counts["pool_blocks_pinned_total"] == 10 and counts["pool_blocks_renewed_total"] == 5
    assert counts["pool_blocks_stored_total"] == 5  # renewals are not new objects


def test_blocks_another_engine_just_stored_for_this_request_are_not_rewritten():
    """P/D: prefill stores (and pins) the prompt; decode pulls it and stores the same blocks.
    They are not decode's reused history, so decode does not upsert them again."""
    store, clock = FakePoolStore(), Clock()
    prefill, decode = _worker(store, clock), _worker(store, clock)
    req = request(prompt_len=64)
    assert prefill.store(blocks_of(req, [0, 1, 2, 3]), session=True) == 4
    assert decode.store(blocks_of(req, [0, 1, 2, 3]), session=True, history_blocks=0) == 0
    assert not store.upserts and decode.snapshot()["pool_blocks_already_pooled_total"] == 4


def test_a_request_outside_sessions_pins_nothing_and_the_budget_bounds_pins():
    store, clock = FakePoolStore(), Clock()
    engine = _worker(store, clock, budget_objects=2)
    req = request(prompt_len=80)
    engine.store(blocks_of(req, [0]), session=False)
    assert not store.pins
    engine.store(blocks_of(req, [0, 1, 2, 3]), session=True)
    assert len(store.pins) == 2 and len(store.objects) == 4  # past the budget: stored, unpinned


def test_a_held_object_only_on_disk_is_never_upserted():
    """An upsert of a disk-only object that Mooncake refuses leaves its key unreadable for ~30 s
    (measured on 0.3.13): such objects are left to Mooncake's promotion on hit."""
    store, clock = FakePoolStore(disk_tier=True), Clock()
    engine = _worker(store, clock)
    req = request(prompt_len=48)
    engine.store(blocks_of(req, [0, 1, 2]), session=True)
    keys = [KEYS.key(h, 0) for h in req.block_hashes]
    store.on_disk = {keys[0]}
    clock.now_s += 45
    engine.store(blocks_of(req, [0, 1, 2]), session=True, history_blocks=3)
    assert sorted(store.upserts) == sorted(keys[1:])


def test_a_prefill_replica_asks_its_engine_under_the_clients_session():
    """P/D: prefill stores the prompt's blocks first, so its engine request must name the session
    too, or the history a session's first turn computes is stored unpinned."""
    import asyncio

    from deployments.records import EngineRequest, SamplingSpec

    from tests.unit.engine_fakes import recording_server

    server, engine = recording_server()
    asyncio.run(server.prefill(EngineRequest("p-1", [1, 2, 3], SamplingSpec(max_tokens=4), session_id="agent-7",
                                             cache_salt="tenant-1")))
    (asked,) = engine.requests
    assert asked.produce_kv and asked.session_id == "agent-7" and asked.cache_salt == "tenant-1"
