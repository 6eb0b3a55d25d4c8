"""The coordinated SLO-driven controller (pure): signals, bounds, budget, cooldowns, holds,
expert-parallel groups, ratio bounds, scale to and from zero (baselines and replay:
test_autoscaler_baselines_replay.py)."""

import random
from dataclasses import replace
from pathlib import Path

import pytest

from autoscaler.controller import CoordinatedController
from autoscaler.errors import AutoscalerConfigError
from autoscaler.observations import ControllerConfig, PoolLimits, PoolObservation

DATA = Path(__file__).resolve().parent / "data"


def config(**overrides) -> ControllerConfig:
    base = dict(ttft_slo_s=2.0, itl_slo_s=0.1, budget_units=100.0, scale_out_cooldown_s=60.0,
                scale_in_cooldown_s=300.0, scale_in_calm_s=0.0, stale_after_s=60.0, hysteresis=0.2, max_step=4,
                scale_to_zero_idle_s=600.0)
    base.update(overrides)
    return ControllerConfig(**base)


PREFILL = PoolLimits("prefill", min_replicas=1, max_replicas=20, units_per_replica=1.0, running_capacity_per_replica=1)
DECODE = PoolLimits("decode", min_replicas=1, max_replicas=20, units_per_replica=2.0, running_capacity_per_replica=64)


def prefill(replicas=4, ttft=1.0, queue=0.5, running=3.0, **extra) -> PoolObservation:
    """Defaults sit inside the band: busy 3/4 of 1 (83% of the 0.9 threshold), TTFT half the SLO."""
    return PoolObservation("prefill", "prefill", replicas, ttft_p90_s=ttft, queue_depth=queue, running=running,
                           arrival_rps=extra.pop("arrival_rps", 5.0), **extra)


def decode(replicas=4, itl=0.085, running=200.0, kv=0.5, **extra) -> PoolObservation:
    """Defaults sit inside the band: ITL 85% of the SLO, 50 of 64 sequences per replica."""
    return PoolObservation("decode", "decode", replicas, ranks_per_replica=extra.pop("ranks_per_replica", 1),
                           itl_p90_s=itl, running=running, kv_cache_usage=kv,
                           arrival_rps=extra.pop("arrival_rps", 5.0), **extra)


def controller(limits=(PREFILL, DECODE), **overrides) -> CoordinatedController:
    return CoordinatedController(config(**overrides), list(limits))


def by_pool(decisions):
    return {d.pool: d for d in decisions.decisions}


def decide_twice(policy, observations):
    """Signals barely over a threshold need a second look (15 s later) before a scale-out."""
    first = policy.decide(observations, 0.0)
    return first if first.changed() else policy.decide(observations, 15.0)


# --- signals and monotonicity ---

def test_inside_the_band_nothing_moves():
    result = controller().decide([prefill(), decode()], 0.0)
    assert not result.held and result.changed() == ()
    assert all("within band" in d.reason for d in result.decisions)


def test_ttft_over_slo_with_a_queue_scales_prefill_out_and_says_why():
    result = by_pool(controller().decide([prefill(ttft=3.0, queue=6.0, running=4.0), decode()], 0.0))
    assert result["prefill"].target > 4
    assert "ttft p90 3.00s > SLO 2.00s" in result["prefill"].reason
    assert result["decode"].target == 4


def test_barely_over_needs_a_second_look():
    policy = controller()
    slightly = [prefill(ttft=2.2, queue=4.0, running=4.0), decode()]  # 1.1x the SLO, within 1 + h
    first = by_pool(policy.decide(slightly, 0.0))["prefill"]
    assert first.target == 4 and "second look" in first.reason
    assert by_pool(policy.decide([prefill(), decode()], 15.0))["prefill"].target == 4  # it was noise
    policy.decide(slightly, 30.0)
    assert by_pool(policy.decide(slightly, 45.0))["prefill"].target > 4  # twice in a row: real


def test_ttft_without_a_prefill_queue_does_not_grow_prefill():
    # Late first tokens with idle prefill replicas: the time goes elsewhere (decode admission).
    result = by_pool(controller().decide([prefill(ttft=5.0, queue=0.0, running=2.0), decode()], 0.0))
    assert result["prefill"].target == 4
    assert "not counted: no prefill queue" in result["prefill"].reason


@pytest.mark.parametrize("signal", ["itl", "running", "kv", "queue"])
def test_each_decode_signal_over_its_threshold_scales_decode_out(signal):
    over = {"itl": dict(itl=0.13), "running": dict(running=250.0), "kv": dict(kv=0.95),
            "queue": dict(queue_depth=20.0)}[signal]
    result = by_pool(decide_twice(controller(), [prefill(), decode(**over)]))
    assert result["decode"].target > 4, result["decode"].reason


def _load(level: float) -> list[PoolObservation]:
    """Everything a pool reports grows with the offered load `level` (1.0 = inside the band)."""
    return [prefill(ttft=1.2 * level, queue=0.6 * level ** 2, running=min(3.2 * level, 4.0), arrival_rps=5 * level),
            decode(itl=0.07 * level, running=min(190.0 * level, 256.0), kv=min(0.5 * level, 1.0),
                   queue_depth=max(0.0, 190.0 * level - 256.0), arrival_rps=5 * level)]


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_more_load_never_yields_fewer_replicas(pool):
    levels = [0.1 * step for step in range(1, 40)]
    targets = [controller().decide(_load(level), 0.0).targets()[pool] for level in levels]
    assert targets == sorted(targets)
    assert targets[0] < 4 < targets[-1]  # the sweep covers scale-in, hold and scale-out


@pytest.mark.parametrize("field,values", [
    ("ttft_p90_s", [0.1, 1.0, 1.9, 2.1, 3.0, 10.0]), ("queue_depth", [0.0, 1.0, 4.0, 8.0, 50.0]),
    ("running", [0.5, 2.0, 3.0, 3.7, 4.0])])
def test_monotone_in_each_prefill_signal_alone(field, values):
    targets = [controller().decide([replace(prefill(queue=1.0), **{field: v}), decode()], 0.0).targets()["prefill"]
               for v in values]
    assert targets == sorted(targets)


# --- bounds, budget, expert-parallel groups, ratio ---

def test_random_observations_respect_limits_step_and_budget():
    rng = random.Random(7)
    limits = (PREFILL, replace(DECODE, max_replicas=12))
    for _ in range(300):
        policy = controller(limits, budget_units=30.0, ratio_bounds=(0.25, 4.0))
        obs = [prefill(replicas=rng.randint(1, 12), ttft=rng.uniform(0.1, 8), queue=rng.uniform(0, 40),
                       running=rng.uniform(0, 12)),
               decode(replicas=rng.randint(1, 9), itl=rng.uniform(0.02, 0.3), running=rng.uniform(0, 700),
                      kv=rng.uniform(0, 1), queue_depth=rng.uniform(0, 50))]
        result = policy.decide(obs, 0.0)
        targets = result.targets()
        for limit in limits:
            assert limit.min_replicas <= targets[limit.pool] <= limit.max_replicas
        current_units = obs[0].replicas * 1.0 + obs[1].replicas * 2.0
        used = targets["prefill"] * 1.0 + targets["decode"] * 2.0
        assert used <= max(30.0, current_units)  # never grows past the budget
        if current_units <= 30.0:
            assert used <= 30.0
        for d in result.decisions:
            assert abs(d.target - d.current) <= 4 and d.reason


def test_scarce_budget_goes_to_the_most_violated_pool():
    # Both pools want more; 4 units are left. Decode is 3x over its ITL SLO, prefill 1.3x over TTFT.
    policy = controller(budget_units=4 + 4 * 2.0 + 4.0)
    result = by_pool(policy.decide([prefill(ttft=2.6, queue=6.0, running=4.0),
                                    decode(itl=0.3, running=256.0, queue_depth=30.0)], 0.0))
    assert result["decode"].target - 4 > result["prefill"].target - 4
    assert result["prefill"].target + 2 * result["decode"].target <= 16
    assert "budget" in result["prefill"].reason


def test_pool_under_its_slo_lends_budget_to_one_over_it():
    # The budget is full; prefill is busy 2 of 10 (needs 3); decode is saturated.
    policy = controller(budget_units=10 + 5 * 2.0, scale_in_calm_s=300.0)  # prefill would not scale in yet
    result = by_pool(policy.decide([prefill(replicas=10, ttft=0.5, queue=0.0, running=2.0),
                                    decode(replicas=5, itl=0.2, running=320.0, queue_depth=40.0)], 0.0))
    assert result["decode"].target > 5
    assert result["prefill"].target < 10
    assert "gave" in result["prefill"].reason and "decode" in result["prefill"].reason
    assert result["prefill"].target + 2 * result["decode"].target <= 20


def test_expert_parallel_groups_scale_whole_and_cost_their_ranks():
    group = PoolLimits.for_group("decode", ranks_per_replica=16, units_per_rank=0.125, min_replicas=1,
                                 max_replicas=10, running_capacity_per_replica=256)
    assert group.units_per_replica == 2.0
    policy = controller((PREFILL, group), budget_units=4 + 2.0 * 6, max_step=8)
    result = by_pool(policy.decide([prefill(), decode(replicas=3, ranks_per_replica=16, itl=0.4,
                                                      running=768.0, queue_depth=400.0)], 0.0))
    target = result["decode"].target
    assert isinstance(target, int) and target == 6  # whole groups, as many as the 12 spare units buy
    assert 4 * 1.0 + target * 2.0 <= 16.0


def test_ratio_bounds_raise_the_short_side():
    policy = controller(ratio_bounds=(0.5, 2.0), max_step=8)
    result = by_pool(policy.decide([prefill(replicas=4, ttft=6.0, queue=40.0, running=4.0), decode(replicas=2)], 0.0))
    p, d = result["prefill"].target, result["decode"].target
    assert p > 4 and 0.5 <= p / d <= 2.0
    assert "prefill:decode <= 2" in result["decode"].reason


def test_ratio_bounds_lower_the_long_side_when_the_short_one_cannot_grow():
    limits = (PREFILL, replace(DECODE, max_replicas=2))
    policy = controller(limits, ratio_bounds=(0.5, 2.0), max_step=8)
    result = by_pool(policy.decide([prefill(replicas=4, ttft=6.0, queue=40.0, running=4.0), decode(replicas=2)], 0.0))
    assert result["decode"].target == 2 and result["prefill"].target == 4
    assert "prefill:decode <= 2" in result["prefill"].reason


def test_decode_keeps_its_replicas_while_prefill_grows():
    result = by_pool(controller().decide([prefill(ttft=4.0, queue=10.0, running=4.0),
                                          decode(itl=0.03, running=40.0, kv=0.1)], 0.0))
    assert result["prefill"].target > 4 and result["decode"].target == 4
    assert "kept at 4" in result["decode"].reason


def test_starting_replicas_count_as_already_ordered():
    policy = controller()
    busy = dict(ttft=3.0, queue=6.0, running=4.0)
    first = by_pool(policy.decide([prefill(**busy), decode()], 0.0))["prefill"]
    assert first.target > 4
    # Next decision after the cooldown: the new replicas are still loading, the load unchanged.
    later = by_pool(policy.decide([prefill(replicas=first.target, starting_replicas=first.target - 4, **busy),
                                   decode()], 120.0))["prefill"]
    assert later.target == first.target and "starting" in later.reason


# --- cooldowns and hysteresis ---

def test_direction_changes_at_most_once_per_cooldown_window():
    policy = controller(scale_out_cooldown_s=60.0, scale_in_cooldown_s=300.0)
    changes, replicas = [], 4
    for tick in range(240):  # an hour, every 15 s, load flipping between far too much and far too little
        now = 15.0 * tick
        high = (tick // 2) % 2 == 0
        obs = prefill(replicas, ttft=6.0, queue=20.0, running=replicas) if high \
            else prefill(replicas, ttft=0.2, queue=0.0, running=0.2)
        result = by_pool(policy.decide([obs, decode()], now))["prefill"]
        if result.target != replicas:
            changes.append((now, 1 if result.target > replicas else -1))
        replicas = result.target
    assert len(changes) >= 4  # it does react
    for (t0, _), (t1, direction) in zip(changes, changes[1:]):
        assert t1 - t0 >= 60.0
        if direction < 0:
            assert t1 - t0 >= 300.0  # scale-in waits the longer cooldown after any change
    for start in range(0, 3600, 15):
        flips = [1 for (a, da), (b, db) in zip(changes, changes[1:]) if da != db and start <= b < start + 60]
        assert len(flips) <= 1


def _noisy_steady(policy, replicas, ticks=200, seed=3):
    """A fixed offered load; what each replica sees depends on how many there are, plus noise."""
    rng = random.Random(seed)
    history, d = [replicas], 6
    for tick in range(ticks):
        n = history[-1]
        busy = 9.0 * (1 + rng.gauss(0, 0.05))  # prefill: ~9 busy replicas' worth of work
        seqs = 300.0 * (1 + rng.gauss(0, 0.05))  # decode: ~300 running sequences, 6 replicas of 64
        queue = max(0.0, rng.gauss(0.5, 0.5)) + 10.0 * max(0.0, busy - 0.9 * n)  # queues build near saturation
        obs = [prefill(n, ttft=0.8 * (1 + rng.gauss(0, 0.1)), queue=queue, running=min(busy, n),
                       arrival_rps=40 * (1 + rng.gauss(0, 0.03))),
               decode(d, itl=0.06 * (1 + rng.gauss(0, 0.05)), running=min(seqs, 64.0 * d), kv=0.4,
                      arrival_rps=40 * (1 + rng.gauss(0, 0.03)))]
        targets = policy.decide(obs, 15.0 * tick).targets()
        history.append(targets["prefill"])
        assert targets["decode"] == d  # decode sits inside its band throughout
    return history


def test_noisy_steady_load_does_not_oscillate():
    # 11 replicas for ~9 busy: inside the band; 200 noisy decisions (50 minutes).
    for seed in range(5):
        history = _noisy_steady(controller(scale_in_calm_s=120.0, forecast_horizon_s=300.0), 11, seed=seed)
        assert sum(1 for a, b in zip(history, history[1:]) if a != b) <= 1, history


@pytest.mark.parametrize("start", [6, 8, 16, 20])
def test_noisy_steady_load_from_a_wrong_size_settles_without_turning_back(start):
    history = _noisy_steady(controller(scale_in_calm_s=120.0, forecast_horizon_s=300.0), start)
    steps = [b - a for a, b in zip(history, history[1:]) if a != b]
    assert steps and (all(step > 0 for step in steps) or all(step < 0 for step in steps)), history
    assert len(steps) <= 3 and 10 <= history[-1] <= 13, history


def test_scale_in_waits_for_a_calm_stretch_and_takes_its_peak():
    policy = controller(scale_in_calm_s=120.0)
    quiet = [prefill(replicas=10, ttft=0.3, queue=0.0, running=2.0), decode()]
    busier = [prefill(replicas=10, ttft=0.3, queue=0.0, running=5.0), decode()]
    assert policy.decide(quiet, 0.0).targets()["prefill"] == 10
    assert policy.decide(busier, 60.0).targets()["prefill"] == 10
    result = by_pool(policy.decide(quiet, 120.0))["prefill"]
    assert result.target == 7  # sized for the stretch's busiest moment: ceil(5 / 0.9 / 0.9)
    assert "calm for 120s" in result.reason


def test_a_busy_wish_ages_out_of_the_calm_window():
    # The tail of a load step is calm but still wants 2 replicas; then the pool goes quiet and
    # stays calm. The wish must leave the 120 s window: a peak kept for the whole calm stretch
    # pinned the pool at 2 for as long as it stayed calm (seen on the real stack in CI).
    policy = controller(scale_in_calm_s=120.0)
    tail = [prefill(replicas=2, ttft=0.3, queue=0.0, running=1.4), decode()]  # 0.7 of 1 each: calm
    quiet = [prefill(replicas=2, ttft=0.3, queue=0.0, running=0.0), decode()]
    assert policy.decide(tail, 0.0).targets()["prefill"] == 2
    assert policy.decide(quiet, 60.0).targets()["prefill"] == 2
    held = by_pool(policy.decide(quiet, 120.0))["prefill"]
    assert held.target == 2 and "2 replicas needed" in held.reason  # the tail is 120 s old: still in
    result = by_pool(policy.decide(quiet, 135.0))["prefill"]
    assert result.target == 1 and "scale in: calm for 135s" in result.reason


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

def _idle(pool_obs, replicas):
    return replace(pool_obs, replicas=replicas, ttft_p90_s=None, itl_p90_s=None, queue_depth=0.0, running=0.0,
                   arrival_rps=0.0, kv_cache_usage=0.0)


def test_scale_to_zero_only_after_the_idle_time_and_only_if_allowed():
    limits = (replace(PREFILL, min_replicas=0), replace(DECODE, min_replicas=0))
    policy = controller(limits, scale_to_zero_idle_s=300.0, scale_in_calm_s=10_000.0)
    targets = [policy.decide([_idle(prefill(), 2), _idle(decode(), 2)], t).targets() for t in range(0, 301, 15)]
    assert all(t == {"prefill": 2, "decode": 2} for t in targets[:-1])
    assert targets[-1] == {"prefill": 0, "decode": 0}
    never = controller(scale_to_zero_idle_s=300.0, scale_in_calm_s=10_000.0)  # min_replicas 1
    for t in range(0, 3601, 15):
        assert min(never.decide([_idle(prefill(), 1), _idle(decode(), 1)], t).targets().values()) == 1


def test_scale_from_zero_at_the_first_request_and_wake_the_partner():
    limits = (replace(PREFILL, min_replicas=0), replace(DECODE, min_replicas=0))
    policy = controller(limits)
    assert policy.decide([_idle(prefill(), 0), _idle(decode(), 0)], 0.0).targets() == {"prefill": 0, "decode": 0}
    waking = replace(_idle(prefill(), 0), queue_depth=1.0, arrival_rps=0.1)
    result = by_pool(policy.decide([waking, _idle(decode(), 0)], 15.0))
    assert result["prefill"].target == 1 and "waking from zero" in result["prefill"].reason
    assert result["decode"].target == 1 and "woken with prefill" in result["decode"].reason


def test_no_scale_to_zero_while_replicas_start_and_idle_time_counts_from_the_first_ready():
    limits = (replace(PREFILL, min_replicas=0), DECODE)
    policy = controller(limits, scale_to_zero_idle_s=30.0, scale_in_calm_s=10_000.0)
    busy_decode = decode(replicas=1, running=1.0, kv=0.01)
    starting = _idle(prefill(replicas=1, starting_replicas=1), 1)
    for now_s in (0.0, 20.0, 40.0):  # idle-looking for 40 s, but still starting
        result = by_pool(policy.decide([starting, busy_decode], now_s))
        assert result["prefill"].target == 1 and "starting" in result["prefill"].reason
    ready = _idle(prefill(replicas=1), 1)
    assert by_pool(policy.decide([ready, busy_decode], 60.0))["prefill"].target == 1
    assert by_pool(policy.decide([ready, busy_decode], 80.0))["prefill"].target == 1  # idle 20 s < 30 s
    assert by_pool(policy.decide([ready, busy_decode], 95.0))["prefill"].target == 0  # idle 35 s


def test_a_pool_without_ready_replicas_has_no_metrics_to_be_stale():
    # At zero (or all starting) no engine exports: its newest sample is old or missing. That
    # must not hold the controller, or a pool at zero could never wake up.
    limits = (replace(PREFILL, min_replicas=0), DECODE)
    policy = controller(limits)
    asleep = replace(_idle(prefill(), 0), metrics_age_s=1e9, queue_depth=2.0, arrival_rps=0.5)
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
