"""The coordinated SLO-driven controller (pure): signals and monotonicity, bounds, budget,
expert-parallel groups, ratio bounds, cooldowns and hysteresis (holds, zero and colocated pools:
test_autoscaler_holds_and_zero.py; baselines and replay: test_autoscaler_baselines_replay.py)."""

import random
from dataclasses import replace

import pytest

from autoscaler.observations import PoolLimits
from tests.unit.autoscaler_cases import DECODE, PREFILL, by_pool, controller, decide_twice, decode, load_at, prefill


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


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_more_load_never_yields_fewer_replicas(pool):
    levels = [0.1 * step for step in range(1, 40)]
    targets = [controller().decide(load_at(level), 0.0).targets()[pool] for level in levels]
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
