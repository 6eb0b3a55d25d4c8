"""Conditional disaggregation (decode chosen first, then whether to skip the remote prefill)
and admission control, on hand-made states."""

import pytest

from deployments.routing.admission import AdmissionGate, AdmissionLimits
from deployments.routing.block_hashes import prompt_block_hashes
from deployments.routing.pairing import DisaggregationRule, local_prefill_reason
from deployments.routing.policies import PrefixAware
from deployments.routing.state import ReplicaState, RoutingRequest

NOW = 50.0
BLOCK = 16


def idle(*names):
    return [ReplicaState(name, reported_at_s=NOW) for name in names]


def req(tokens):
    return RoutingRequest(prompt_block_hashes(tokens, BLOCK))


def decide(tokens, decode_policy=None, decodes=("d0",), pool_hit_blocks=0, **rule):
    """As the ingress decides: decode by its policy first, then rule 2 on that replica."""
    decision = (decode_policy or PrefixAware()).choose(req(tokens), idle(*decodes), NOW)
    return decision, local_prefill_reason(decision, len(tokens), BLOCK, pool_hit_blocks, DisaggregationRule(**rule))


def test_a_long_uncached_prompt_goes_to_a_remote_prefill():
    decision, reason = decide(list(range(1024)), decodes=("d0", "d1"))
    assert reason is None and decision.replica_id in ("d0", "d1")


def test_a_short_prompt_is_computed_on_decode():
    assert decide(list(range(100)), min_uncached_tokens=256)[1] == "short_uncached"
    assert decide(list(range(300)), min_uncached_tokens=256)[1] is None


def test_a_long_prompt_whose_prefix_the_pool_holds_is_short_work():
    # 1024 tokens, 60 blocks (960) in the pool: 64 uncached tokens.
    assert decide(list(range(1024)), pool_hit_blocks=60, min_uncached_tokens=256)[1] == "short_uncached"
    assert decide(list(range(1024)), pool_hit_blocks=40, min_uncached_tokens=256)[1] is None


def test_decode_that_already_holds_most_of_the_prompt_keeps_it_local():
    policy = PrefixAware()
    history = list(range(1024))
    decide(history, policy, min_uncached_tokens=0)  # turn 1: d0 computes the history
    decision, reason = decide(history + list(range(5000, 5128)), policy, min_uncached_tokens=0, local_hit_fraction=0.8)
    assert (decision.replica_id, decision.expected_hit_blocks, reason) == ("d0", 64, "decode_holds_prefix")
    # A stricter threshold (the history is 89% of this prompt) sends it to a remote prefill.
    decision, reason = decide(history + list(range(6000, 6128)), policy, min_uncached_tokens=0, local_hit_fraction=0.95)
    assert reason is None


def test_no_decode_replica_means_no_decision():
    assert PrefixAware().choose(req(list(range(1024))), [], NOW) is None


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


def test_prompt_tokens_in_flight_are_bounded_with_the_requests():
    """A 32k-token prompt is not one short prompt: with 40k tokens allowed, one long prompt and
    a few short ones get in; a second long one waits for room, whatever the request count."""
    g = gate(max_running=8, max_queued=8, max_prompt_tokens=40_000)
    long_slot = g.take(NOW, prompt_tokens=32_000)
    assert [g.admit(NOW, prompt_tokens=500) for _ in range(4)] == [None] * 4
    rejection = g.admit(NOW, prompt_tokens=32_000)
    assert rejection is not None and g.in_flight == 5 and g.prompt_tokens_in_flight == 34_000
    assert rejection.reason == "34000 prompt tokens in flight and this request's 32000 exceed the limit of 40000"
    assert g.admit(NOW, prompt_tokens=500) is None  # short ones still fit
    long_slot.release(NOW)
    long_slot.release(NOW)  # given back once
    assert g.prompt_tokens_in_flight == 2_500 and g.admit(NOW, prompt_tokens=32_000) is None


def test_a_prompt_longer_than_the_token_bound_is_admitted_alone():
    g = gate(max_prompt_tokens=1_000)
    assert g.admit(NOW, prompt_tokens=5_000) is None  # nothing else could ever make room for it
    assert g.admit(NOW, prompt_tokens=10) is not None
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        gate(max_prompt_tokens=0)


def test_the_manifest_token_bound_is_per_serving_engine_split_over_ingress_replicas():
    from pathlib import Path

    from cluster.manifest import load_manifest
    from cluster.manifest_routing import AdmissionSpec

    manifest = load_manifest(Path(__file__).resolve().parents[3] / "manifests" / "local-long-context.yaml")
    decode = manifest.pools[1]
    assert manifest.admission.limits_per_ingress(decode, ingress_replicas=1)["max_prompt_tokens"] == 196_608
    spec = AdmissionSpec(max_prompt_tokens_per_replica=100_001)
    assert spec.limits_per_ingress(decode, ingress_replicas=2)["max_prompt_tokens"] == 50_001
    assert AdmissionSpec().limits_per_ingress(decode, ingress_replicas=1)["max_prompt_tokens"] is None
