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
SECRET = "5e" * 32
# One settings for both roles: an engine of a P/D application that lends KV (prefill) and
# pulls it (decode); each test drives one role.
SETTINGS = ConnectorSettings(host="10.0.0.7", port=47001, engine_id="prefill-engine-0", lease_s=8.0,
                             grant_secret=SECRET, lends_kv=True)


@dataclass
class FakeRequest:
    request_id: str
    kv_transfer_params: dict | None
    prompt_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


def prefill_request(request_id="p-1", prompt_len=40, params=None) -> FakeRequest:
    params = prefill_request_params() if params is None else params
    return FakeRequest(request_id, params, list(range(prompt_len)), num_computed_tokens=prompt_len)


def remote_params(request_id="p-1", block_ids=(11, 12, 13), num_tokens=40, secret=SECRET) -> TransferParams:
    """What a prefill engine of this application hands decode: signed with the application's secret."""
    from dataclasses import replace

    from kv_transfer.grants import GrantKey

    deadline_s = time.time() + 8.0
    unsigned = TransferParams(
        remote_host="10.0.0.7", remote_port=47001, remote_engine_id="prefill-engine-0",
        remote_request_id=request_id, remote_block_ids=tuple(block_ids), remote_num_tokens=num_tokens,
        block_size_tokens=BLOCK_SIZE, lease_deadline_unix_s=deadline_s)
    grant = GrantKey(secret).payload(unsigned.grant_scope(), int(deadline_s * 1000))
    return replace(unsigned, grant=grant.hex())


def decode_request(request_id="d-1", prompt_len=40, transfer=None) -> FakeRequest:
    """A decode request as our engine server makes it: the prefill's signed parameters."""
    transfer = remote_params() if transfer is None else transfer
    return FakeRequest(request_id, transfer.to_engine(), list(range(prompt_len)), num_computed_tokens=0)


def replace_settings(**changes) -> ConnectorSettings:
    from dataclasses import replace

    return replace(SETTINGS, **changes)


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


def test_prefill_signs_its_lease_grant_over_engine_request_and_blocks():
    from dataclasses import replace

    from kv_transfer.grants import GrantKey, GrantScope

    side = SchedulerSide(SETTINGS, BLOCK_SIZE)
    _, engine_params = side.finished(prefill_request("p-9", prompt_len=40), [5, 6, 7], normally=True)
    transfer = TransferParams.from_engine(engine_params)
    grant = transfer.grant_bytes()
    # Signed with the deadline decode is told, in milliseconds of this clock.
    assert int.from_bytes(grant[32:], "big") == int(transfer.lease_deadline_unix_s * 1000)
    key, now_ms = GrantKey(SECRET), int(time.time() * 1000)
    scope = GrantScope("prefill-engine-0", "10.0.0.7", 47001, "p-9", (5, 6, 7))
    assert key.check(scope, grant, now_ms) is None
    # The grant opens this lease only: another request, other blocks, another engine or
    # another address do not verify.
    for other in (replace(scope, request_id="p-8"), replace(scope, block_ids=(5, 6, 7, 8)),
                  replace(scope, block_ids=(5, 6)), replace(scope, engine_id="prefill-engine-1"),
                  replace(scope, host="10.0.0.8"), replace(scope, port=47002)):
        assert key.check(other, grant, now_ms) is not None, other
    assert GrantKey("6f" * 32).check(scope, grant, now_ms) is not None  # another application's key


@pytest.mark.parametrize("changes", [{"lends_kv": False}, {"grant_secret": ""}],
                         ids=["engine-lends-no-kv", "no-secret"])
def test_only_a_lending_engine_with_a_secret_keeps_blocks_whatever_the_request_asks(changes):
    side = SchedulerSide(replace_settings(**changes), BLOCK_SIZE)
    assert side.finished(prefill_request("p-1"), [5, 6], normally=True) == (False, None)
    assert empty(side.take_plan())


@pytest.mark.parametrize("lease_s", [1.5, 3600, 1e308, float("nan"), -1, "x"])
def test_the_lease_length_is_the_engines_own_never_the_requests(side, lease_s):
    request = prefill_request(params={PRODUCE_KEY: True, "lease_s": lease_s})
    before_s = time.time()
    _, engine_params = side.finished(request, [1, 2, 3], normally=True)
    assert side.take_plan().grants == [LeaseGrant("p-1", (1, 2, 3), 8.0)]
    assert before_s + 8.0 <= TransferParams.from_engine(engine_params).lease_deadline_unix_s <= time.time() + 8.0


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


# -- hostile or foreign transfer parameters: refused on the scheduler thread, never raised ------


def forged(**changes) -> dict:
    return {**remote_params().to_engine(), **changes}


@pytest.mark.parametrize("params", [
    pytest.param({CONSUME_KEY: True, "remote_num_tokens": "x"}, id="reported-engine-killer"),
    pytest.param(forged(remote_num_tokens="x"), id="num-tokens-text"),
    pytest.param(forged(remote_num_tokens=-5), id="num-tokens-negative"),
    pytest.param(forged(remote_num_tokens=10**9), id="num-tokens-beyond-the-blocks"),
    pytest.param(forged(remote_port="47001"), id="port-text"),
    pytest.param(forged(remote_port=0), id="port-zero"),
    pytest.param(forged(remote_port=True), id="port-bool"),
    pytest.param(forged(remote_block_ids="abc"), id="blocks-text"),
    pytest.param(forged(remote_block_ids=[1, 1]), id="blocks-repeated"),
    pytest.param(forged(remote_block_ids=[-1]), id="blocks-negative"),
    pytest.param(forged(remote_block_ids=[{"a": 1}]), id="blocks-objects"),
    pytest.param(forged(lease_deadline_unix_s=float("nan")), id="deadline-nan"),
    pytest.param(forged(lease_remaining_s="inf"), id="remaining-text"),
    pytest.param(forged(grant="zz" * 40), id="grant-not-hex"),
    pytest.param(forged(remote_host=""), id="host-empty"),
    pytest.param(forged(remote_host=["a"]), id="host-list"),
])
def test_malformed_pull_params_are_refused_without_raising(side, params):
    request = FakeRequest("d-1", params, list(range(40)))
    assert side.num_new_matched_tokens(request, 0) == (0, False)
    side.after_alloc(request, [70, 71], num_external_tokens=0)
    assert side.finished(request, [], normally=False) == (False, None)
    assert empty(side.take_plan())
    assert side.refused_params_total == 1  # decided once per request


@pytest.mark.parametrize("params", [
    pytest.param(forged(remote_host="169.254.169.254"), id="redirected-host"),
    pytest.param(forged(remote_port=6379), id="redirected-port"),
    pytest.param(forged(remote_block_ids=[11, 12, 13, 14], remote_num_tokens=50), id="more-blocks"),
    pytest.param(forged(remote_request_id="someone-else"), id="other-request"),
    pytest.param(forged(remote_engine_id="prefill-engine-9"), id="other-engine"),
    pytest.param(forged(grant=""), id="unsigned"),
    pytest.param(remote_params(secret="6f" * 32).to_engine(), id="another-applications-key"),
])
def test_pull_params_no_engine_of_this_application_signed_are_refused(side, params):
    """A forged record must never make the engine connect anywhere or load foreign KV."""
    request = FakeRequest("d-1", params, list(range(40)))
    assert side.num_new_matched_tokens(request, 0) == (0, False)
    side.after_alloc(request, [70, 71, 72], num_external_tokens=40)
    assert empty(side.take_plan())
    assert side.refused_params_total == 1


def test_a_signed_lease_of_another_tp_size_is_refused_and_computed_here(side):
    """Prefill with TP 2, this decode engine TP 1: no rank here holds what rank r there does, so
    the prompt is computed locally (failure_policy never sees it), and forging the TP size to
    match fails the grant instead."""
    from dataclasses import replace

    from kv_transfer.grants import GrantKey

    unsigned = replace(remote_params(), grant="", remote_tp_size=2)
    deadline_ms = int(unsigned.lease_deadline_unix_s * 1000)
    tp2 = replace(unsigned, grant=GrantKey(SECRET).payload(unsigned.grant_scope(), deadline_ms).hex())
    for params in (tp2.to_engine(), {**tp2.to_engine(), "remote_tp_size": 1}):
        fresh = SchedulerSide(replace_settings(), BLOCK_SIZE)
        request = FakeRequest("d-1", params, list(range(40)))
        assert fresh.num_new_matched_tokens(request, 0) == (0, False)
        assert fresh.refused_params_total == 1


def test_an_engine_without_a_secret_pulls_nothing():
    side = SchedulerSide(replace_settings(grant_secret=""), BLOCK_SIZE)
    assert side.num_new_matched_tokens(decode_request(), 0) == (0, False)


def test_not_a_dict_is_no_params(side):
    for params in (["do_remote_prefill"], "do_remote_prefill", 7):
        request = FakeRequest("d-1", params, list(range(40)))
        assert side.num_new_matched_tokens(request, 0) == (0, False)
        assert side.finished(request, [1], normally=True) == (False, None)
    assert empty(side.take_plan())
