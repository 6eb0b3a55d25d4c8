"""The discrete-event cluster simulator and its traces: conservation, the service model's
arithmetic, startup and drain, cluster capacity, SLO accounting, speed, and policies compared."""

import math
from dataclasses import replace

import numpy as np
import pytest

from autoscaler.baselines import FixedSplit, QueueLengthPerPool
from autoscaler.controller import CoordinatedController
from autoscaler.observations import ControllerConfig, Decision, PoolLimits, ScalingDecisions
from autoscaler.service_model import CPU_TINY_MODEL, H200_DEEPSEEK_V3
from autoscaler.simulator import SimConfig, SimPool, simulate
from autoscaler.traces import Lengths, Trace, bursty, diurnal, shift, steady

MODEL = CPU_TINY_MODEL  # prefill 20 ms + 0.3 ms/token, decode step 25 ms + 1 ms/sequence, start 40 s


def sim_config(prefill=2, decode=2, cluster_units=8.0, **overrides) -> SimConfig:
    base = dict(prefill=SimPool("prefill", prefill), decode=SimPool("decode", decode), model=MODEL,
                cluster_units=cluster_units, ttft_slo_s=2.0, itl_slo_s=0.2, control_interval_s=15.0,
                metrics_window_s=60.0)
    base.update(overrides)
    return SimConfig(**base)


class Scripted:
    """Sets the targets given for a time once that time is reached; records what it observed."""

    def __init__(self, plan: dict[float, dict[str, int]] | None = None):
        self.plan = sorted((plan or {}).items())
        self.seen: list[tuple[float, dict]] = []

    def decide(self, observations, now_s):
        self.seen.append((now_s, {obs.pool: obs for obs in observations}))
        targets = {obs.pool: obs.replicas for obs in observations}
        for at_s, wanted in self.plan:
            if now_s >= at_s:
                targets.update(wanted)
        self.plan = [(at_s, wanted) for at_s, wanted in self.plan if at_s > now_s]
        return ScalingDecisions(tuple(Decision(obs.pool, obs.replicas, targets[obs.pool], "scripted")
                                      for obs in observations), now_s)


def one_request(prompt_tokens: int, output_tokens: int, at_s: float = 1.0) -> Trace:
    return Trace("one", 10.0, np.array([at_s]), np.array([prompt_tokens]), np.array([output_tokens]))


# --- the service model's arithmetic ---

def test_a_lone_request_takes_prefill_hop_and_one_step_per_token():
    report = simulate(sim_config(), one_request(100, 10), FixedSplit())
    prefill_s = MODEL.prefill_base_s + 100 * MODEL.prefill_s_per_token
    first_token_s = prefill_s + MODEL.kv_transfer_s(100) + MODEL.decode_step_s(1)
    assert report.completed == 1 and report.slo_met == 1
    assert report.ttft_p90_s == pytest.approx(first_token_s, rel=1e-9)
    assert report.itl_p90_s == pytest.approx(MODEL.decode_step_s(1), rel=1e-9)


def test_sequences_sharing_a_decode_replica_step_together():
    # Two identical requests at once, one decode replica: both decode at batch 2.
    trace = Trace("pair", 10.0, np.array([1.0, 1.0]), np.array([100, 100]), np.array([50, 50]))
    report = simulate(sim_config(prefill=2, decode=1), trace, FixedSplit())
    # The first admitted dates its first token at batch 1 (an approximation of the model): off by 1/49 ms.
    assert report.itl_p90_s == pytest.approx(MODEL.decode_step_s(2), rel=1e-3)


def test_a_full_decode_replica_makes_requests_wait_for_a_slot():
    small = replace(MODEL, max_batch=1)
    trace = Trace("pair", 10.0, np.array([1.0, 1.0]), np.array([100, 100]), np.array([20, 20]))
    report = simulate(sim_config(prefill=2, decode=1, model=small), trace, FixedSplit())
    one_decode_s = 20 * small.decode_step_s(1)
    alone = small.prefill_s(100) + small.kv_transfer_s(100) + small.decode_step_s(1)
    assert report.completed == 2
    # The second waited for the first to finish: p90 of the two TTFTs (numpy's linear interpolation).
    assert report.ttft_p90_s == pytest.approx(np.percentile([alone, alone + one_decode_s], 90), rel=1e-6)


# --- conservation, startup, drain, capacity ---

@pytest.mark.parametrize("policy_name", ["coordinated", "scripted-drain", "queue-length"])
def test_every_request_completes_exactly_once(policy_name):
    trace = bursty(600.0, 2.0, 8.0, Lengths(300), Lengths(40), mean_burst_s=40.0, mean_gap_s=120.0, seed=1)
    policy = {"coordinated": lambda: CoordinatedController(_controller_config(), _limits()),
              "scripted-drain": lambda: Scripted({60.0: {"decode": 3, "prefill": 3}, 200.0: {"decode": 1},
                                                  300.0: {"prefill": 1}, 400.0: {"prefill": 4, "decode": 3}}),
              "queue-length": lambda: QueueLengthPerPool(_limits(), {"prefill": 0.8, "decode": 8.0},
                                                         upscale_delay_s=15.0, downscale_delay_s=60.0)}[policy_name]()
    report = simulate(sim_config(), trace, policy)
    assert report.requests == len(trace) > 1000
    assert report.unfinished == 0 and report.completed == report.requests  # n finish events over n requests
    assert report.end_s >= trace.duration_s


def test_new_replicas_serve_only_after_startup():
    policy = Scripted({30.0: {"prefill": 4}})
    simulate(sim_config(), steady(200.0, 1.0, Lengths(100), Lengths(10)), policy)
    starting = {round(t): seen["prefill"].starting_replicas for t, seen in policy.seen}
    assert starting[15] == 0 and starting[45] == 2 and starting[60] == 2  # ordered at 30, loading for 40 s
    assert starting[75] == 0


def test_the_cluster_places_only_what_fits():
    # Asking for 12 prefill replicas on 8 units with 2 decode: 6 placed, the rest wait.
    policy = Scripted({15.0: {"prefill": 12}})
    report = simulate(sim_config(), steady(300.0, 2.0, Lengths(100), Lengths(10)), policy)
    late = [seen for t, seen in policy.seen if t > 15.0 + MODEL.replica_startup_s + 15.0][0]["prefill"]
    assert late.replicas == 12 and late.starting_replicas == 6
    assert report.total_unit_seconds <= 8.0 * report.end_s + 1e-6


def test_unit_seconds_count_units_per_replica():
    config = replace(sim_config(prefill=1), decode=SimPool("decode", 1, units_per_replica=2.0, ranks_per_replica=2))
    report = simulate(config, one_request(10, 2), FixedSplit())
    assert report.unit_seconds["prefill"] == pytest.approx(report.end_s)
    assert report.unit_seconds["decode"] == pytest.approx(2.0 * report.end_s)


def test_pools_go_to_zero_when_idle_and_wake_for_the_next_request():
    early = steady(100.0, 2.0, Lengths(200), Lengths(20), seed=6)
    late = steady(100.0, 2.0, Lengths(200), Lengths(20), seed=7)
    trace = Trace("gap", 1100.0, np.concatenate([early.arrival_s, late.arrival_s + 1000.0]),
                  np.concatenate([early.prompt_tokens, late.prompt_tokens]),
                  np.concatenate([early.output_tokens, late.output_tokens]))
    limits = [replace(limit, min_replicas=0) for limit in _limits()]
    policy = CoordinatedController(replace(_controller_config(), scale_to_zero_idle_s=120.0), limits)
    report = simulate(sim_config(), trace, policy)
    sizes = {round(point["t"]): (point["prefill"], point["decode"]) for point in report.timeline}
    assert sizes[900] == (0, 0)
    assert sizes[1020] >= (1, 1)
    assert report.unfinished == 0 and report.completed == len(trace)


# --- SLO accounting and policies ---

def test_fixed_split_meets_the_slo_when_underloaded():
    report = simulate(sim_config(prefill=2, decode=2), steady(600.0, 2.0, Lengths(300), Lengths(40)), FixedSplit())
    assert report.slo_attainment >= 0.99
    assert report.goodput_rps == pytest.approx(report.slo_met / 600.0)
    assert report.goodput_per_unit_s == pytest.approx(report.slo_met / report.total_unit_seconds)


def test_overload_shows_up_as_missed_slo():
    report = simulate(sim_config(prefill=1, decode=1), steady(300.0, 6.0, Lengths(1500), Lengths(40)), FixedSplit())
    assert report.slo_attainment < 0.5 and report.unfinished == 0


def _limits() -> list[PoolLimits]:
    return [PoolLimits("prefill", 1, 6, 1.0, 1), PoolLimits("decode", 1, 6, 1.0, MODEL.max_batch)]


def _controller_config() -> ControllerConfig:
    return ControllerConfig(ttft_slo_s=2.0, itl_slo_s=0.2, budget_units=8.0, ratio_bounds=(0.25, 4.0),
                            scale_out_cooldown_s=30.0, scale_in_cooldown_s=120.0, scale_in_calm_s=120.0,
                            max_step=2, forecast_horizon_s=MODEL.replica_startup_s)


def test_coordinated_beats_fixed_split_per_unit_on_the_shift_trace():
    trace = shift(1200.0, 3.0, Lengths(200), Lengths(1500), Lengths(64), seed=2)
    fixed = simulate(sim_config(prefill=4, decode=4), trace, FixedSplit(), "fixed-split")
    ours = simulate(sim_config(prefill=2, decode=2), trace, CoordinatedController(_controller_config(), _limits()),
                    "coordinated")
    assert ours.goodput_per_unit_s >= fixed.goodput_per_unit_s
    assert ours.slo_attainment >= 0.85  # it gives some up after the shift: replicas take 40 s to start
    assert ours.scaling_changes >= 1  # it did adapt, not merely start small


def test_same_inputs_same_report():
    trace = diurnal(600.0, 3.0, Lengths(300), Lengths(40), seed=4)
    runs = [simulate(sim_config(), trace, CoordinatedController(_controller_config(), _limits())).summary()
            for _ in range(2)]
    for run in runs:
        run.pop("wall_s"), run.pop("cpu_s")
    assert runs[0] == runs[1]


def test_a_short_simulation_is_quick():
    trace = steady(600.0, 20.0, Lengths(300), Lengths(100), seed=5)  # ~12k requests
    report = simulate(sim_config(prefill=4, decode=4, cluster_units=16.0), trace,
                      QueueLengthPerPool(_limits(), {"prefill": 0.8, "decode": 12.0}))
    assert report.completed == len(trace) > 10_000
    assert report.cpu_s < 5.0  # ~0.5 s on an idle core: per request O(log n), no per-token events


def test_calibrations_are_in_their_documented_ranges():
    assert 0.030 <= H200_DEEPSEEK_V3.decode_step_s(64) <= 0.035
    assert 0.045 <= H200_DEEPSEEK_V3.decode_step_s(256) <= 0.055
    assert H200_DEEPSEEK_V3.replica_startup_s == 300.0 and MODEL.replica_startup_s == 40.0


# --- traces ---

def test_traces_are_seeded():
    a, b = steady(300.0, 5.0, Lengths(100), Lengths(10), seed=1), steady(300.0, 5.0, Lengths(100), Lengths(10), seed=1)
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens, b.prompt_tokens)
    c = steady(300.0, 5.0, Lengths(100), Lengths(10), seed=2)
    assert not np.array_equal(a.arrival_s, c.arrival_s)


def test_trace_shapes():
    flat = steady(3600.0, 10.0, Lengths(100), Lengths(10))
    assert flat.mean_rps == pytest.approx(10.0, rel=0.05)
    assert np.all(np.diff(flat.arrival_s) >= 0)
    day = diurnal(3600.0, 10.0, Lengths(100), Lengths(10), amplitude=0.6)
    trough = np.sum(day.arrival_s < 600.0)
    peak = np.sum((day.arrival_s >= 1500.0) & (day.arrival_s < 2100.0))
    assert peak > 3 * trough
    bursts = bursty(3600.0, 2.0, 20.0, Lengths(100), Lengths(10), seed=3)
    per_minute = np.bincount((bursts.arrival_s // 60).astype(int))
    assert per_minute.max() > 5 * np.median(per_minute)
    moved = shift(600.0, 5.0, Lengths(100), Lengths(2000), Lengths(10))
    before, after = moved.prompt_tokens[moved.arrival_s < 300.0], moved.prompt_tokens[moved.arrival_s >= 300.0]
    assert before.max() <= 150 and after.min() >= 1000
    assert math.isclose(Lengths(100, 0.5).sample(np.random.default_rng(0), 10_000).mean(), 100, rel_tol=0.02)
