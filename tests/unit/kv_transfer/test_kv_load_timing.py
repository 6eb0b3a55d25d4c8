"""What a request's KV loads cost travels worker -> scheduler -> output -> ingress, where it
becomes the `pool_load` phase (carved out of the phase that contained it, so the phases
still add up to the end-to-end latency)."""

import time

import pytest

from kv_transfer.connector_scheduler import SchedulerSide, StepPlan
from kv_transfer.connector_worker import WorkerSide
from kv_transfer.params import LOAD_TIMING_KEY, LoadTiming, TransferParams, is_transfer
from kv_transfer.settings import ConnectorSettings
from monitoring.metrics import Phase
from monitoring.phases import RequestMarks, request_phases
from tests.unit.kv_transfer.test_kv_connector_worker import BytePages, free_port
from tests.unit.kv_transfer.test_kv_pool_tier import BS, blocks_of, request, worker
from tests.unit.kv_grant_fakes import SECRET
from tests.unit.kv_pool_fakes import FakePoolStore

SETTINGS = ConnectorSettings(port=0)
# A prefill engine of a P/D application: it lends KV and signs its grants.
PREFILL_SETTINGS = ConnectorSettings(port=47001, engine_id="prefill-0", grant_secret=SECRET, lends_kv=True)


def _finished_recving(side: WorkerSide, request_id: str) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if request_id in side.results()[1]:
            return
        time.sleep(0.01)
    raise AssertionError(f"{request_id} never finished loading")


def test_a_pool_load_is_timed_by_the_worker_and_drained_once():
    from kv_transfer.connector_scheduler import PullJob

    store = FakePoolStore()
    source = worker(store)
    source.attach(BytePages(seed=5))
    req = request(prompt_len=48)
    source.store(blocks_of(req, [0, 1, 2]))
    side = WorkerSide(ConnectorSettings(port=free_port()), pool=worker(store))
    try:
        side.register(BytePages())
        side.apply(StepPlan(pulls=[PullJob(req.request_id, None, (), (), tuple(blocks_of(req, [7, 8, 9])))]))
        _finished_recving(side, req.request_id)
        times = side.take_load_times()
        assert set(times) == {req.request_id}
        timing = times[req.request_id]
        assert timing.pool_blocks == 3 and timing.pool_s > 0 and timing.pull_blocks == 0 and timing.pull_s == 0
        assert side.take_load_times() == {}
    finally:
        side.shutdown()


def test_the_worker_times_what_the_disk_tier_served_within_the_pool_load():
    from kv_transfer.connector_scheduler import PullJob

    store = FakePoolStore(disk_tier=True)
    source = worker(store)
    source.attach(BytePages(seed=6))
    req = request(prompt_len=48)
    source.store(blocks_of(req, [0, 1, 2]))
    store.on_disk = set(list(store.objects)[:1])  # the master demoted the oldest
    side = WorkerSide(ConnectorSettings(port=free_port()), pool=worker(store))
    try:
        side.register(BytePages())
        side.apply(StepPlan(pulls=[PullJob(req.request_id, None, (), (), tuple(blocks_of(req, [7, 8, 9])))]))
        _finished_recving(side, req.request_id)
        timing = side.take_load_times()[req.request_id]
        assert timing.pool_blocks == 3 and timing.pool_disk_blocks == 1
        assert 0 < timing.pool_disk_s <= timing.pool_s
    finally:
        side.shutdown()


def test_a_failed_pool_load_is_reported_to_the_scheduler_side():
    from kv_transfer.connector_scheduler import PullJob

    req = request(prompt_len=48)
    side = WorkerSide(ConnectorSettings(port=free_port()), pool=worker(FakePoolStore()))  # an empty pool
    try:
        side.register(BytePages())
        side.apply(StepPlan(pulls=[PullJob(req.request_id, None, (), (), tuple(blocks_of(req, [7, 8, 9])))]))
        _finished_recving(side, req.request_id)
        timing = side.take_load_times()[req.request_id]
        assert timing.pool_failed and timing.pool_blocks == 0
        assert timing.slower(LoadTiming(0.1, 3)).pool_failed  # any rank's failure counts
    finally:
        side.shutdown()


def test_the_scheduler_returns_the_timing_with_the_finished_request():
    side = SchedulerSide(SETTINGS, BS)
    req = request("r-9", prompt_len=40, num_computed_tokens=40)
    side.record_load_times({"r-9": LoadTiming(0.02, 2, 0.0, 0)})
    side.record_load_times({"r-9": LoadTiming(0.03, 2, 0.0, 0)})  # a second rank, slower
    delay, out = side.finished(req, [1, 2, 3], normally=True)
    assert not delay and LoadTiming.from_engine(out) == LoadTiming(0.03, 2, 0.0, 0)
    assert not is_transfer(out)  # a timing alone is not a prefill's transfer
    assert side.finished(req, [1, 2, 3], normally=True) == (False, None)  # collected once


def test_a_prefill_carries_its_pool_timing_inside_its_transfer_params():
    side = SchedulerSide(PREFILL_SETTINGS, BS)
    req = request("p-1", prompt_len=40, num_computed_tokens=40, kv_transfer_params={"do_remote_decode": True})
    side.record_load_times({"p-1": LoadTiming(0.5, 1)})
    delay, out = side.finished(req, [1, 2, 3], normally=True)
    assert delay and is_transfer(out)
    assert TransferParams.from_engine(out).remote_block_ids == (1, 2, 3)
    assert out[LOAD_TIMING_KEY]["pool_s"] == 0.5


def test_timings_of_requests_that_never_finish_are_bounded(monkeypatch):
    from kv_transfer import connector_scheduler

    monkeypatch.setattr(connector_scheduler, "_MAX_PENDING_TIMINGS", 3)
    side = SchedulerSide(SETTINGS, BS)
    side.record_load_times({f"r-{i}": LoadTiming(0.1, 1) for i in range(5)})
    assert side.finished(request("r-0"), [], normally=False) == (False, None)  # dropped: oldest
    assert side.finished(request("r-4"), [], normally=False)[1] is not None


@pytest.mark.parametrize("disaggregated", [False, True])
def test_pool_load_is_its_own_phase_and_the_phases_still_add_up(disaggregated):
    marks = RequestMarks(received=0.0, dispatched=0.01, first_token=0.61, last_token=1.61, done=1.62,
                         prefill_done=0.31 if disaggregated else None)
    phases = request_phases(marks, queue_s=0.05, first_token_s=0.2, disaggregated=disaggregated,
                            engine_pool_s=0.08, prefill_pool_s=0.1)
    engine_phase = Phase.kv_transfer if disaggregated else Phase.first_token_compute
    assert phases[engine_phase] == pytest.approx(0.12)
    assert phases[Phase.pool_load] == pytest.approx(0.18 if disaggregated else 0.08)
    if disaggregated:
        assert phases[Phase.prefill] == pytest.approx(0.2)
    assert sum(phases.values()) == pytest.approx(1.62)


@pytest.mark.parametrize("disaggregated", [False, True])
def test_what_the_disk_tier_served_is_its_own_phase_carved_from_the_pool_load(disaggregated):
    marks = RequestMarks(received=0.0, dispatched=0.01, first_token=0.61, last_token=1.61, done=1.62,
                         prefill_done=0.31 if disaggregated else None)
    phases = request_phases(marks, queue_s=0.05, first_token_s=0.2, disaggregated=disaggregated,
                            engine_pool_s=0.08, prefill_pool_s=0.1, engine_pool_disk_s=0.05, prefill_pool_disk_s=0.04)
    assert phases[Phase.pool_disk_load] == pytest.approx(0.09 if disaggregated else 0.05)
    assert phases[Phase.pool_load] == pytest.approx(0.09 if disaggregated else 0.03)
    assert sum(phases.values()) == pytest.approx(1.62)


def test_a_disk_time_above_its_pool_read_is_clamped_to_it():
    marks = RequestMarks(0.0, 0.01, 0.5, 1.0, 1.01)
    phases = request_phases(marks, 0.05, 0.2, disaggregated=False, engine_pool_s=0.08, engine_pool_disk_s=0.5)
    assert phases[Phase.pool_disk_load] == pytest.approx(0.08) and Phase.pool_load not in phases
    assert sum(phases.values()) == pytest.approx(1.01)


def test_disk_timing_crosses_the_engine_boundary_and_ranks_wait_for_the_slowest():
    timing = LoadTiming(0.3, 12, pool_disk_s=0.2, pool_disk_blocks=5)
    assert LoadTiming.from_engine({LOAD_TIMING_KEY: timing.to_engine()}) == timing
    merged = timing.slower(LoadTiming(0.4, 12, pool_disk_s=0.1, pool_disk_blocks=7))
    assert (merged.pool_s, merged.pool_disk_s, merged.pool_disk_blocks) == (0.4, 0.2, 7)


def test_no_pool_load_phase_without_pool_reads():
    marks = RequestMarks(0.0, 0.01, 0.5, 1.0, 1.01)
    assert Phase.pool_load not in request_phases(marks, 0.05, 0.2, disaggregated=False)
