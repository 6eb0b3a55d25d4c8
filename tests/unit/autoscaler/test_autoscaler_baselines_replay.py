"""The baseline policies, decision reasons, and the replay of a recorded metrics trace."""

import json
from dataclasses import replace

from autoscaler.baselines import FixedSplit, QueueLengthPerPool
from autoscaler.controller import CoordinatedController
from autoscaler.replay import load_case, replay
from tests.unit.autoscaler_cases import DATA, DECODE, PREFILL, controller, decode, idle, load_at, prefill


# --- baselines ---

def test_fixed_split_never_changes():
    policy = FixedSplit()
    for t, obs in enumerate([load_at(0.1), load_at(5.0), load_at(1.0)]):
        result = policy.decide(obs, 15.0 * t)
        assert result.changed() == () and all(d.reason for d in result.decisions)
    assert policy.decide(None, 60.0).held


def test_queue_length_baseline_follows_ray_serve_rule_with_delays():
    policy = QueueLengthPerPool([PREFILL, DECODE], {"prefill": 1.0, "decode": 32.0},
                                upscale_delay_s=30.0, downscale_delay_s=600.0)
    busy = [prefill(replicas=4, queue=6.0, running=4.0), decode(replicas=4, running=128.0)]
    assert policy.decide(busy, 0.0).targets() == {"prefill": 4, "decode": 4}  # wanted, not yet for 30 s
    assert policy.decide(busy, 15.0).targets()["prefill"] == 4
    assert policy.decide(busy, 30.0).targets()["prefill"] == 10  # ceil((6 + 4) / 1)
    quiet = [prefill(replicas=10, queue=0.0, running=1.0), decode(replicas=4, running=128.0)]
    assert policy.decide(quiet, 45.0).targets()["prefill"] == 10
    assert policy.decide(quiet, 645.0).targets()["prefill"] == 1
    cold = QueueLengthPerPool([replace(PREFILL, min_replicas=0), DECODE], {"prefill": 1.0, "decode": 32.0})
    woken = cold.decide([replace(idle(prefill(), 0), queue_depth=2.0), decode()], 0.0)
    assert woken.targets()["prefill"] == 2


# --- reasons and replay ---

def test_every_decision_carries_a_reason():
    policy = controller(ratio_bounds=(0.25, 4.0), budget_units=20.0)
    for level in [0.2, 0.5, 1.0, 2.0, 5.0, 1.0, 0.1]:
        for d in policy.decide(load_at(level), 15.0).decisions:
            assert d.reason.strip()


def test_replay_matches_recorded_event_log():
    """A change to the scaling rules that changes these decisions must update the expected log
    on purpose: `.venv/bin/python -m autoscaler.replay tests/unit/data/autoscaler_replay.json`."""
    config_, limits, recorded = load_case(DATA / "autoscaler_replay.json")
    events = replay(CoordinatedController(config_, limits), recorded)
    expected = json.loads((DATA / "autoscaler_replay_expected.json").read_text())
    assert events == expected
    kinds = {(e["event"], e.get("to") == 0) for e in events}
    assert ("hold", False) in kinds and ("scale", True) in kinds  # the case covers holds and zero
    assert all(e["reason"] for e in events)
