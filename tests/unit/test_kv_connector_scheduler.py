"""Scheduler side of the KV connector (pure; no vLLM): what prefill keeps, what decode pulls.

Requests are a small fake carrying exactly the attributes SchedulerSide reads from vLLM's
Request: request_id, kv_transfer_params (a dict, mutated in place as vLLM's is),
prompt_token_ids and num_computed_tokens.
"""

import time
from dataclasses import dataclass, field

import pytest

from kv_transfer.connector_scheduler import LeaseGrant, PullJob, SchedulerSide, StepPlan
from kv_transfer.params import CONSUME_KEY, PRODUCE_KEY, TransferParams, prefill_request_params
from kv_transfer.settings import ConnectorSettings

BLOCK_SIZE = 16
SETTINGS = ConnectorSettings(host="10.0.0.7", port=47001, engine_id="prefill-engine-0", lease_s=8.0)


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict | None
    prompt_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


def prefill_request(request_id="p-1", prompt_len=40, params=None) -> FakeRequest:
    params = prefill_request_params() if params is None else params
    return FakeRequest(request_id, params, list(range(prompt_len)), num_computed_tokens=prompt_len)


def remote_params(request_id="p-1", block_ids=(11, 12, 13), num_tokens=40) -> TransferParams:
    return TransferParams(
        remote_host="10.0.0.7", remote_port=47001, remote_engine_id="prefill-engine-0",
        remote_request_id=request_id, remote_block_ids=tuple(block_ids), remote_num_tokens=num_tokens,
        block_size_tokens=BLOCK_SIZE, lease_deadline_unix_s=time.time() + 8.0)


def decode_request(request_id="d-1", prompt_len=40, transfer=None) -> FakeRequest:
    transfer = remote_params() if transfer is None else transfer
    return FakeRequest(request_id, transfer.to_engine(), list(range(prompt_len)), num_computed_tokens=0)


@pytest.fixture
def side() -> SchedulerSide:
    return SchedulerSide(SETTINGS, BLOCK_SIZE)


def empty(plan: StepPlan) -> bool:
    return not (plan.pulls or plan.grants or plan.releases)


# -- prefill role -----------------------------------------------------------------------------


def test_prefill_normal_finish_holds_blocks_and_names_them(side):
    request = prefill_request("p-1", prompt_len=40)
    before_s = time.time()
    delay_free, engine_params = side.finished(request, [5, 6, 7], normally=True)
    after_s = time.time()

    assert delay_free is True
    assert engine_params[CONSUME_KEY] is True  # the decode engine will pull with these
    transfer = TransferParams.from_engine(engine_params)
    assert (transfer.remote_host, transfer.remote_port, transfer.remote_engine_id) == (
        "10.0.0.7", 47001, "prefill-engine-0")
    assert transfer.remote_request_id == "p-1"
    assert transfer.remote_block_ids == (5, 6, 7)
    assert transfer.remote_num_tokens == 40
    assert transfer.block_size_tokens == BLOCK_SIZE
    assert before_s + 8.0 <= transfer.lease_deadline_unix_s <= after_s + 8.0
    assert transfer.inject_failure is False

    plan = side.take_plan()
    assert plan.grants == [LeaseGrant("p-1", (5, 6, 7), 8.0)]
    assert plan.pulls == [] and plan.releases == []


def test_prefill_signs_its_lease_grant_when_the_application_has_a_secret():
    from dataclasses import replace

    from kv_transfer.grants import GrantKey

    secret = "5e" * 32
    side = SchedulerSide(replace(SETTINGS, grant_secret=secret), BLOCK_SIZE)
    _, engine_params = side.finished(prefill_request("p-9", prompt_len=40), [5, 6, 7], normally=True)
    transfer = TransferParams.from_engine(engine_params)
    grant = transfer.grant_bytes()
    # Signed over the request id and the deadline decode is told, in milliseconds of this clock.
    assert int.from_bytes(grant[32:], "big") == int(transfer.lease_deadline_unix_s * 1000)
    assert GrantKey(secret).check("p-9", grant, int(time.time() * 1000)) is None
    assert GrantKey(secret).check("p-8", grant, int(time.time() * 1000)) is not None
    unsigned = SchedulerSide(SETTINGS, BLOCK_SIZE).finished(prefill_request("p-9"), [5], normally=True)[1]
    assert TransferParams.from_engine(unsigned).grant == ""  # grants off: nothing to present


def test_prefill_lease_length_can_come_with_the_request(side):
    request = prefill_request(params={PRODUCE_KEY: True, "lease_s": 1.5})
    before_s = time.time()
    _, engine_params = side.finished(request, [1], normally=True)
    assert side.take_plan().grants == [LeaseGrant("p-1", (1,), 1.5)]
    assert TransferParams.from_engine(engine_params).lease_deadline_unix_s < before_s + 8.0


@pytest.mark.parametrize("params, block_ids, normally", [
    pytest.param(prefill_request_params(), [5, 6], False, id="aborted"),
    pytest.param(None, [5, 6], True, id="no-params"),
    pytest.param({}, [5, 6], True, id="empty-params"),
    pytest.param({PRODUCE_KEY: False}, [5, 6], True, id="produce-off"),
    pytest.param(prefill_request_params(), [], True, id="no-blocks"),
])
def test_prefill_without_something_to_hand_over_frees_at_once(side, params, block_ids, normally):
    request = FakeRequest("p-1", params, list(range(40)), 40)
    assert side.finished(request, block_ids, normally) == (False, None)
    assert empty(side.take_plan())


# -- decode role ------------------------------------------------------------------------------


def test_decode_reports_the_uncomputed_prompt_as_loadable_asynchronously(side):
    request = decode_request(prompt_len=40)
    assert side.num_new_matched_tokens(request, 0) == (40, True)
    # A local prefix-cache hit of one block leaves the rest to load.
    assert side.num_new_matched_tokens(request, 16) == (24, True)


def test_decode_never_loads_more_than_the_prompt(side):
    # The prefill may have computed past the prompt; only prompt tokens are loadable.
    request = decode_request(prompt_len=40, transfer=remote_params(num_tokens=41))
    assert side.num_new_matched_tokens(request, 0) == (40, True)


@pytest.mark.parametrize("params", [None, {}, {PRODUCE_KEY: True}, {**remote_params().to_engine(), CONSUME_KEY: False}],
                         ids=["none", "empty", "prefill-params", "already-consumed"])
def test_decode_without_params_to_consume_loads_nothing(side, params):
    request = FakeRequest("d-1", params, list(range(40)))
    assert side.num_new_matched_tokens(request, 0) == (0, False)


def test_decode_with_everything_computed_loads_nothing(side):
    request = decode_request(prompt_len=40)
    assert side.num_new_matched_tokens(request, 40) == (0, False)


def test_after_alloc_pulls_the_remote_tail_that_matches_the_local_unhashed_blocks(side):
    # Remote blocks 11, 12, 13 hold the 40-token prompt; block 0 of it was a local prefix hit,
    # so vLLM hands us two fresh (unhashed) blocks for the rest: they get remote 12 and 13.
    transfer = remote_params(block_ids=(11, 12, 13))
    request = decode_request(transfer=transfer)
    side.after_alloc(request, [70, 71], num_external_tokens=24)

    plan = side.take_plan()
    assert plan.pulls == [PullJob("d-1", transfer, local_block_ids=(70, 71), remote_block_ids=(12, 13))]
    assert plan.grants == [] and plan.releases == []
    assert request.kv_transfer_params[CONSUME_KEY] is False

    # One pull per request: asking again (vLLM may) schedules nothing, and nothing is loadable.
    side.after_alloc(request, [70, 71], num_external_tokens=24)
    assert empty(side.take_plan())
    assert side.num_new_matched_tokens(request, 16) == (0, False)


def test_after_alloc_without_a_local_hit_pulls_every_remote_block_in_order(side):
    transfer = remote_params(block_ids=(11, 12, 13))
    request = decode_request(transfer=transfer)
    side.after_alloc(request, [3, 9, 4], num_external_tokens=40)
    (job,) = side.take_plan().pulls
    assert (job.local_block_ids, job.remote_block_ids) == ((3, 9, 4), (11, 12, 13))


@pytest.mark.parametrize("local_blocks, external_tokens", [([], 24), ([70, 71], 0), ([], 0)],
                         ids=["no-local-blocks", "no-external-tokens", "neither"])
def test_after_alloc_with_nothing_to_pull_releases_the_prefill_lease(side, local_blocks, external_tokens):
    transfer = remote_params()
    request = decode_request(transfer=transfer)
    side.after_alloc(request, local_blocks, external_tokens)
    plan = side.take_plan()
    assert plan.releases == [transfer]
    assert plan.pulls == [] and plan.grants == []
    assert request.kv_transfer_params[CONSUME_KEY] is False
    side.after_alloc(request, local_blocks, external_tokens)
    assert empty(side.take_plan())  # released once, not per call


def test_after_alloc_ignores_requests_without_params(side):
    side.after_alloc(FakeRequest("d-1", None, list(range(40))), [1, 2], 32)
    side.after_alloc(FakeRequest("d-2", prefill_request_params(), list(range(40))), [1, 2], 32)
    assert empty(side.take_plan())


def test_decode_request_finished_before_allocation_releases_the_prefill_lease(side):
    transfer = remote_params()
    request = decode_request(transfer=transfer)  # consume flag still set: never allocated
    assert side.finished(request, [], normally=False) == (False, None)
    plan = side.take_plan()
    assert plan.releases == [transfer]
    assert plan.pulls == [] and plan.grants == []
    assert request.kv_transfer_params[CONSUME_KEY] is False
    assert side.finished(request, [], normally=False) == (False, None)
    assert empty(side.take_plan())  # a second finish does not release twice


def test_decode_request_finished_after_its_pull_releases_nothing_more(side):
    request = decode_request()
    side.after_alloc(request, [70, 71, 72], num_external_tokens=40)
    side.take_plan()
    # The worker releases after pulling; finishing the request must not add a second release
    # nor hold the decode blocks (they are not a prefill's to lend).
    assert side.finished(request, [70, 71, 72], normally=True) == (False, None)
    assert empty(side.take_plan())


# -- every step -------------------------------------------------------------------------------


def test_take_plan_hands_over_everything_once_and_resets(side):
    side.finished(prefill_request("p-1"), [5], normally=True)
    side.finished(prefill_request("p-2"), [6, 7], normally=True)
    side.after_alloc(decode_request("d-1"), [1, 2, 3], 40)
    side.after_alloc(decode_request("d-2"), [], 0)

    plan = side.take_plan()
    assert [g.request_id for g in plan.grants] == ["p-1", "p-2"]
    assert [p.request_id for p in plan.pulls] == ["d-1"]
    assert len(plan.releases) == 1
    assert empty(side.take_plan())
    assert empty(side.take_plan())


def test_aborted_decode_request_is_released_at_once_not_in_a_step_plan_that_may_never_run():
    """An engine with no other request runs no further step; the release must not wait for one."""
    released: list[TransferParams] = []
    side = SchedulerSide(SETTINGS, 16, release_now=released.append)
    transfer = remote_params()
    request = decode_request(transfer=transfer)
    assert side.finished(request, [], normally=False) == (False, None)
    assert released == [transfer]
    assert empty(side.take_plan())
