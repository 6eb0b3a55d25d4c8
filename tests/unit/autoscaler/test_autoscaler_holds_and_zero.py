"""The coordinated controller (pure): holds on stale or unreachable metrics, configuration
errors, scaling to and from zero, and colocated pools."""

from dataclasses import replace

import pytest

from autoscaler.controller import CoordinatedController
from autoscaler.errors import AutoscalerConfigError
from autoscaler.observations import PoolLimits, PoolObservation
from tests.unit.autoscaler_cases import DECODE, PREFILL, by_pool, config, controller, decode, idle, prefill


# --- holds ---

def test_hold_on_stale_metrics():
    result = controller().decide([prefill(ttft=9.0, queue=50.0), decode(metrics_age_s=95.0)], 0.0)
    assert result.held and "stale" in result.hold_reason and "decode 95s" in result.hold_reason
    assert all(d.target == d.current and d.reason.startswith("held:") for d in result.decisions)


@pytest.mark.parametrize("observations", [None, []])
def test_hold_when_metrics_are_unreachable(observations):
    policy = controller()
    before = policy.decide([prefill(replicas=6), decode(replicas=3)], 0.0)
    result = policy.decide(observations, 15.0)
    assert result.held and "unreachable" in result.hold_reason
    assert result.targets() == before.targets()  # the last targets decided


def test_a_hold_right_after_a_change_keeps_the_change():
    # Serve reports the old size until it applies a decision; a hold in between must not
    # send it back (that would restart the replica the scale-out asked for, or just removed).
    policy = controller()
    grown = policy.decide([prefill(replicas=4, ttft=3.0, queue=12.0), decode()], 0.0)
    assert grown.targets()["prefill"] > 4
    held = policy.decide(None, 2.0)
    assert held.held and held.targets() == grown.targets()
    explicit = policy.decide_unreachable(30.0, "prometheus: connection refused")
    assert explicit.held and explicit.hold_reason == "prometheus: connection refused"


@pytest.mark.parametrize("observations", [None, []])
def test_a_fresh_controller_without_metrics_holds_serves_sizes_not_the_minimum(observations):
    # First deploy, a restarted Serve controller or a redeploy: a new controller whose first
    # call finds Prometheus down must keep the pools where Serve has them.
    policy = controller()
    assert (PREFILL.min_replicas, DECODE.min_replicas) != (5, 3)
    result = policy.decide(observations, 0.0, serve_sizes={"prefill": 5, "decode": 3})
    assert result.held and result.targets() == {"prefill": 5, "decode": 3}
    assert all(d.current == d.target for d in result.decisions)


def test_serves_sizes_do_not_undo_this_controllers_own_decision():
    policy = controller()
    grown = policy.decide([prefill(replicas=4, ttft=3.0, queue=12.0), decode()], 0.0)
    held = policy.decide(None, 2.0, serve_sizes={"prefill": 4, "decode": decode().replicas})
    assert held.targets() == grown.targets()  # Serve still reports 4 until it applies the change


def test_hold_when_a_pool_has_no_observation():
    result = controller().decide([prefill(ttft=9.0, queue=50.0)], 0.0)
    assert result.held and "decode" in result.hold_reason
    assert all(d.target == d.current for d in result.decisions)


def test_unknown_pool_is_a_configuration_error():
    with pytest.raises(AutoscalerConfigError, match="known pools"):
        controller().decide([prefill(), decode(), replace(decode(), pool="other")], 0.0)


def test_bad_config_says_the_fix():
    with pytest.raises(AutoscalerConfigError, match="scale_in_cooldown_s >= scale_out_cooldown_s"):
        config(scale_out_cooldown_s=600.0, scale_in_cooldown_s=60.0)
    with pytest.raises(AutoscalerConfigError, match="min_replicas"):
        PoolLimits("p", min_replicas=5, max_replicas=2)


# --- zero ---

def test_scale_to_zero_only_after_the_idle_time_and_only_if_allowed():
    limits = (replace(PREFILL, min_replicas=0), replace(DECODE, min_replicas=0))
    policy = controller(limits, scale_to_zero_idle_s=300.0, scale_in_calm_s=10_000.0)
    targets = [policy.decide([idle(prefill(), 2), idle(decode(), 2)], t).targets() for t in range(0, 301, 15)]
    assert all(t == {"prefill": 2, "decode": 2} for t in targets[:-1])
    assert targets[-1] == {"prefill": 0, "decode": 0}
    never = controller(scale_to_zero_idle_s=300.0, scale_in_calm_s=10_000.0)  # min_replicas 1
    for t in range(0, 3601, 15):
        assert min(never.decide([idle(prefill(), 1), idle(decode(), 1)], t).targets().values()) == 1


def test_scale_from_zero_at_the_first_request_and_wake_the_partner():
    limits = (replace(PREFILL, min_replicas=0), replace(DECODE, min_replicas=0))
    policy = controller(limits)
    assert policy.decide([idle(prefill(), 0), idle(decode(), 0)], 0.0).targets() == {"prefill": 0, "decode": 0}
    waking = replace(idle(prefill(), 0), queue_depth=1.0, arrival_rps=0.1)
    result = by_pool(policy.decide([waking, idle(decode(), 0)], 15.0))
    assert result["prefill"].target == 1 and "waking from zero" in result["prefill"].reason
    assert result["decode"].target == 1 and "woken with prefill" in result["decode"].reason


def test_no_scale_to_zero_while_replicas_start_and_idle_time_counts_from_the_first_ready():
    limits = (replace(PREFILL, min_replicas=0), DECODE)
    policy = controller(limits, scale_to_zero_idle_s=30.0, scale_in_calm_s=10_000.0)
    busy_decode = decode(replicas=1, running=1.0, kv=0.01)
    starting = idle(prefill(replicas=1, starting_replicas=1), 1)
    for now_s in (0.0, 20.0, 40.0):  # idle-looking for 40 s, but still starting
        result = by_pool(policy.decide([starting, busy_decode], now_s))
        assert result["prefill"].target == 1 and "starting" in result["prefill"].reason
    ready = idle(prefill(replicas=1), 1)
    assert by_pool(policy.decide([ready, busy_decode], 60.0))["prefill"].target == 1
    assert by_pool(policy.decide([ready, busy_decode], 80.0))["prefill"].target == 1  # idle 20 s < 30 s
    assert by_pool(policy.decide([ready, busy_decode], 95.0))["prefill"].target == 0  # idle 35 s


def test_a_pool_without_ready_replicas_has_no_metrics_to_be_stale():
    # At zero (or all starting) no engine exports: its newest sample is old or missing. That
    # must not hold the controller, or a pool at zero could never wake up.
    limits = (replace(PREFILL, min_replicas=0), DECODE)
    policy = controller(limits)
    asleep = replace(idle(prefill(), 0), metrics_age_s=1e9, queue_depth=2.0, arrival_rps=0.5)
    result = by_pool(policy.decide([asleep, decode(replicas=1, running=1.0, kv=0.01)], 0.0))
    assert not policy.decide([asleep, decode(replicas=1, running=1.0, kv=0.01)], 15.0).held
    assert result["prefill"].target == 1 and "waking from zero" in result["prefill"].reason
    starting = prefill(replicas=1, starting_replicas=1, metrics_age_s=1e9)
    held = by_pool(policy.decide([starting, decode(replicas=1, running=1.0, kv=0.01)], 30.0))
    assert held["prefill"].target == 1 and "starting" in held["prefill"].reason
    # Once a replica is ready its metrics count again.
    stale = policy.decide([prefill(replicas=1, metrics_age_s=1e9), decode(replicas=1, running=1.0, kv=0.01)], 45.0)
    assert stale.held and "prefill no samples" in stale.hold_reason


# --- colocated ---

def test_colocated_pool_reacts_to_ttft_and_itl():
    pool = PoolLimits("engine", 1, 10, 8.0, 256)
    policy = CoordinatedController(config(), [pool])

    def engine(**kw):
        base = dict(ttft_p90_s=1.0, itl_p90_s=0.08, running=700.0, kv_cache_usage=0.5, queue_depth=1.0)
        base.update(kw)
        return PoolObservation("engine", "colocated", 4, **base)
    assert policy.decide([engine()], 0.0).targets()["engine"] == 4
    assert CoordinatedController(config(), [pool]).decide([engine(itl_p90_s=0.15)], 0.0).targets()["engine"] > 4
    assert CoordinatedController(config(), [pool]).decide([engine(ttft_p90_s=3.0)], 0.0).targets()["engine"] > 4
