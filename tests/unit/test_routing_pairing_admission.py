"""P/D pair choice, conditional disaggregation and admission control, on hand-made states."""

import pytest

from deployments.routing.admission import AdmissionGate, AdmissionLimits
from deployments.routing.block_hashes import prompt_block_hashes
from deployments.routing.pairing import DisaggregationRule, PairRouter
from deployments.routing.policies import PrefixAware
from deployments.routing.state import ReplicaState, RoutingRequest

NOW = 50.0
BLOCK = 16


def idle(*names):
    return [ReplicaState(name, reported_at_s=NOW) for name in names]


def req(tokens):
    return RoutingRequest(prompt_block_hashes(tokens, BLOCK))


def router(**rule):
    return PairRouter(PrefixAware(), BLOCK, DisaggregationRule(**rule))


def test_a_long_uncached_prompt_goes_to_a_remote_prefill():
    tokens = list(range(1024))
    decision = router().choose(req(tokens), len(tokens), idle("d0", "d1"), idle("p0", "p1"), 0, NOW)
    assert decision.reason == "remote_prefill" and decision.prefill is not None
    assert decision.uncached_tokens == 1024


def test_a_short_prompt_is_computed_on_decode():
    tokens = list(range(100))
    decision = router(min_uncached_tokens=256).choose(req(tokens), 100, idle("d0"), idle("p0"), 0, NOW)
    assert (decision.prefill, decision.reason, decision.uncached_tokens) == (None, "short_uncached", 100)


def test_a_long_prompt_whose_prefix_the_pool_holds_is_short_work():
    tokens = list(range(1024))
    decision = router(min_uncached_tokens=256).choose(req(tokens), 1024, idle("d0"), idle("p0"), 60, NOW)
    assert (decision.reason, decision.uncached_tokens) == ("short_uncached", 1024 - 60 * BLOCK)


def test_decode_that_already_holds_most_of_the_prompt_keeps_it_local():
    pair = router(min_uncached_tokens=0, local_hit_fraction=0.8)
    history = list(range(1024))
    pair.choose(req(history), 1024, idle("d0"), idle("p0"), 0, NOW)  # turn 1: d0 computes the history
    turn2 = history + list(range(5000, 5128))
    decision = pair.choose(req(turn2), len(turn2), idle("d0"), idle("p0"), 0, NOW)
    assert (decision.decode.replica_id, decision.reason) == ("d0", "decode_holds_prefix")
    assert decision.decode.expected_hit_blocks == 64


def test_prefill_is_chosen_by_blocks_to_compute_plus_its_queue():
    pair = router(min_uncached_tokens=0, local_hit_fraction=1.1, queued_request_blocks=8)
    shared = list(range(2048))  # 128 blocks
    pair.prefill_index.record_routed("p1", req(shared).block_hashes)
    decodes = idle("d0")
    # p1 holds the prefix: 128 fewer blocks to compute outweighs 3 queued requests (24 blocks).
    prefills = [ReplicaState("p0", reported_at_s=NOW), ReplicaState("p1", ongoing=3, reported_at_s=NOW)]
    assert pair.choose(req(shared + [1] * 64), 2112, decodes, prefills, 0, NOW).prefill.replica_id == "p1"
    # 20 queued requests (160 blocks) outweigh it.
    prefills = [ReplicaState("p0", reported_at_s=NOW), ReplicaState("p1", ongoing=20, reported_at_s=NOW)]
    assert pair.choose(req(shared + [2] * 64), 2112, decodes, prefills, 0, NOW).prefill.replica_id == "p0"


def test_no_prefill_replica_means_decode_computes_and_no_decode_means_no_decision():
    tokens = list(range(1024))
    decision = router(min_uncached_tokens=0).choose(req(tokens), 1024, idle("d0"), [], 0, NOW)
    assert (decision.prefill, decision.reason) == (None, "no_prefill_replica")
    assert router().choose(req(tokens), 1024, [], idle("p0"), 0, NOW) is None


def gate(**kw):
    return AdmissionGate(AdmissionLimits(**{"max_running": 2, "max_queued": 2, **kw}))


def test_admission_admits_up_to_running_plus_queued_then_rejects_at_once():
    g = gate()
    assert [g.admit(NOW) for _ in range(4)] == [None] * 4
    rejection = g.admit(NOW)
    assert rejection is not None and "4 requests in flight" in rejection.reason
    assert rejection.retry_after_s == 30  # nothing has completed yet: the longest wait
    g.release(NOW)
    assert g.admit(NOW) is None and g.in_flight == 4 and g.rejected_total == 1


def test_retry_after_follows_the_completion_rate():
    g = gate(max_queued=0, rate_window_s=10)
    g.admit(0.0), g.admit(0.0)
    for t in range(20):  # 20 completions in 10 s: 2 per second
        g.release(float(t) / 2)
        g.admit(float(t) / 2)
    assert g.admit(10.0).retry_after_s == 1  # one excess request drains in half a second: at least 1 s


def test_low_priority_is_shed_first():
    g = gate(max_running=2, max_queued=4)
    assert [g.admit(NOW, "low") for _ in range(4)] == [None] * 4  # 2 running + half the queue
    assert g.admit(NOW, "low") is not None
    assert g.admit(NOW, "high") is None and g.admit(NOW, "normal") is None
    assert g.admit(NOW, "high") is not None
    with pytest.raises(ValueError, match="known: high, low, normal"):
        g.admit(NOW, "urgent")


def test_nonsense_limits_are_refused():
    with pytest.raises(ValueError):
        AdmissionGate(AdmissionLimits(max_running=0, max_queued=1))


def test_a_check_answers_as_admit_would_without_taking_a_place():
    from deployments.routing.admission import AdmissionGate, AdmissionLimits

    gate = AdmissionGate(AdmissionLimits(max_running=1, max_queued=1))
    assert gate.check(0.0) is None and gate.in_flight == 0
    assert gate.admit(0.0) is None and gate.admit(0.0) is None and gate.in_flight == 2
    rejection = gate.check(0.0)
    assert rejection is not None and gate.in_flight == 2 and gate.rejected_total == 1
    assert gate.check(0.0, "low") is not None  # low may fill half the queue: floor(0.5) = 0
    gate.release(1.0)
    assert gate.check(1.0) is None and gate.check(1.0, "low") is not None
