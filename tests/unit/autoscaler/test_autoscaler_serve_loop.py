"""The Serve actuator's pieces without a cluster: settings from the manifest, the shared decision
loop (fake metrics source and clock), its metrics and recording, and the Serve policy class
driven with AutoscalingContext-shaped fakes."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import yaml

from autoscaler import serve_loop
from autoscaler.controller import CoordinatedController
from autoscaler.observations import PoolObservation
from autoscaler.replay import load_case, replay, replay_targets
from autoscaler.serve_loop import AutoscalerMetrics, DecisionLoop
from autoscaler.serve_policy import CoordinatedPoolPolicy
from autoscaler.settings import AutoscalerSettings, settings_from_manifest
from cluster.manifest import parse_manifest
from monitoring import metrics as m

ROOT = Path(__file__).resolve().parents[3]


def autoscaling_manifest(**autoscaling):
    data = yaml.safe_load((ROOT / "manifests" / "local.yaml").read_text())
    data["pools"][0]["autoscaling"] = {"min_replicas": 1, "max_replicas": 2}
    data["pools"][1]["autoscaling"] = {"min_replicas": 1, "max_replicas": 2, "running_capacity_per_replica": 32}
    data["autoscaling"] = {"decision_interval_s": 2, "scale_out_cooldown_s": 10, "scale_in_cooldown_s": 30,
                           "scale_in_calm_s": 10, "stale_after_s": 20, "metrics_window_s": 30, **autoscaling}
    return parse_manifest(data)


def test_settings_come_from_the_manifest_and_survive_json():
    settings = settings_from_manifest(autoscaling_manifest(budget_units=6))
    assert settings.app == "moe-local" and settings.prometheus_url == "http://127.0.0.1:9090"
    prefill, decode = settings.pools
    assert (prefill.ref.role, prefill.limits.max_replicas, prefill.limits.units_per_replica) == ("prefill", 2, 1.0)
    # A decode replica is a 2-rank expert-parallel group: it costs two ranks' CPUs.
    assert (decode.ref.ranks_per_replica, decode.limits.units_per_replica) == (2, 2.0)
    assert decode.limits.running_capacity_per_replica == 32
    assert settings.controller.ttft_slo_s == 2.0 and settings.controller.ratio_bounds == (0.25, 4.0)
    wire = json.loads(json.dumps(settings.to_json()))  # what Serve's policy_kwargs carry
    assert AutoscalerSettings.from_json(wire) == settings
    unbounded = settings_from_manifest(autoscaling_manifest())
    assert math.isinf(AutoscalerSettings.from_json(json.loads(json.dumps(unbounded.to_json()))).controller.budget_units)


class FakeSource:
    """Observations made from the replica counts the loop passes, with a settable latency."""

    window = "30s"

    def __init__(self):
        self.ttft, self.reachable, self.age, self.asked = 0.5, True, 1.0, []

    def observe(self, replicas, starting):
        self.asked.append((dict(replicas), dict(starting)))
        if not self.reachable:
            return None
        return [PoolObservation("prefill", "prefill", replicas["prefill"], ttft_p90_s=self.ttft,
                                queue_depth=4.0 if self.ttft > 2 else 0.0, running=1.0, arrival_rps=2.0,
                                metrics_age_s=self.age, starting_replicas=starting["prefill"]),
                PoolObservation("decode", "decode", replicas["decode"], ranks_per_replica=2, itl_p90_s=0.05,
                                running=2.0, arrival_rps=2.0, metrics_age_s=self.age,
                                starting_replicas=starting["decode"])]


class FakeExporter:
    def __init__(self):
        self.values, self.counts = {}, {}

    def set(self, metric, value, **labels):
        self.values[(metric.name, tuple(sorted(labels.items())))] = value

    def inc(self, metric, value=1.0, **labels):
        key = (metric.name, tuple(sorted(labels.items())))
        self.counts[key] = self.counts.get(key, 0) + value


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_loop(tmp_path=None):
    source, exporter, clock = FakeSource(), FakeExporter(), Clock()
    loop = DecisionLoop(settings_from_manifest(autoscaling_manifest()), source, metrics=AutoscalerMetrics(exporter),
                        clock=clock, record_path=str(tmp_path / "rec.json") if tmp_path else None)
    return loop, source, exporter, clock


def test_the_loop_waits_for_every_pool_then_scales_the_pool_over_its_slo(tmp_path):
    loop, source, exporter, clock = make_loop(tmp_path)
    assert loop.report("prefill", 1, 1) == 1
    assert loop.step() is None and not source.asked  # decode not reported yet: nothing to size
    assert loop.report("decode", 1, 1) == 1
    source.ttft = 5.0  # far over the 2 s SLO, with prompts queueing
    decisions = loop.step()
    assert decisions.targets() == {"prefill": 2, "decode": 1}
    assert "ttft" in {d.pool: d.reason for d in decisions.decisions}["prefill"]
    # Serve's next policy call for prefill gets the new target; decode keeps its own.
    assert loop.report("prefill", 1, 1) == 2 and loop.report("decode", 1, 1) == 1
    # A replica that is starting is reported as such to the controller.
    clock.now += 2
    loop.report("prefill", 2, 1)
    loop.step()
    assert source.asked[-1] == ({"prefill": 2, "decode": 1}, {"prefill": 1, "decode": 0})
    assert exporter.values[(m.AUTOSCALER_TARGET.name, (("pool", "prefill"),))] == 2
    assert exporter.counts[(m.AUTOSCALER_DECISIONS.name, (("action", "scale_out"), ("pool", "prefill")))] == 1
    assert exporter.values[(m.AUTOSCALER_LAST_DECISION.name, ())] == clock.now


def test_a_loop_started_while_prometheus_is_down_keeps_serves_sizes():
    # A fresh loop (first deploy, Serve controller restart, redeploy) over pools Serve runs at
    # 3 and 2: a hold must answer those sizes, not the pools' minimum of 1.
    loop, source, _, _ = make_loop()
    source.reachable = False
    loop.report("prefill", 3, 3)
    loop.report("decode", 2, 2)
    decisions = loop.step()
    assert decisions.held and decisions.targets() == {"prefill": 3, "decode": 2}
    assert loop.report("prefill", 3, 3) == 3 and loop.report("decode", 2, 2) == 2


def test_unreachable_and_stale_metrics_hold_every_pool_and_say_why():
    loop, source, exporter, clock = make_loop()
    loop.report("prefill", 1, 1)
    loop.report("decode", 1, 1)
    source.reachable = False
    assert loop.step().held and loop.report("prefill", 1, 1) == 1
    holding = {reason: exporter.values[(m.AUTOSCALER_HOLDING.name, (("reason", reason),))]
               for reason in ("unreachable", "stale")}
    assert holding == {"unreachable": 1, "stale": 0}
    source.reachable, source.age, source.ttft = True, 500.0, 9.0  # over the SLO, but the data is old
    clock.now += 2
    decisions = loop.step()
    assert decisions.held and "stale" in decisions.hold_reason and decisions.targets() == {"prefill": 1, "decode": 1}
    assert exporter.values[(m.AUTOSCALER_HOLDING.name, (("reason", "stale"),))] == 1
    source.age = 1.0
    clock.now += 2
    assert not loop.step().held
    assert exporter.values[(m.AUTOSCALER_HOLDING.name, (("reason", "stale"),))] == 0


def test_the_recording_replays_to_the_decisions_the_live_loop_took(tmp_path):
    loop, source, _exporter, clock = make_loop(tmp_path)
    for pool in ("prefill", "decode"):
        loop.report(pool, 1, 1)
    for step, ttft in enumerate([0.5, 5.0, 5.0, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]):
        source.ttft = ttft
        source.reachable = step != 3
        decisions = loop.step()
        for pool, target in decisions.targets().items():  # Serve follows at once, replicas start at once
            loop.report(pool, target, target)
        clock.now += 3
    recorded = json.loads((tmp_path / "rec.json").read_text())
    config, limits, steps = load_case(tmp_path / "rec.json")
    live = [d["targets"] for d in recorded["decisions"]]
    assert {"prefill": 2, "decode": 1} in live and live[-1] == {"prefill": 1, "decode": 1}  # out, then in
    assert replay_targets(CoordinatedController(config, limits), steps) == live
    assert any(e["event"] == "hold" for e in replay(CoordinatedController(config, limits), steps))


def test_a_recording_that_starts_blind_replays_with_serves_sizes(tmp_path):
    """The loop's first steps with its Prometheus down hold every pool at Serve's size (2 here,
    above the minimum of 1); the recording keeps those sizes so a replay holds them too."""
    loop, source, _exporter, clock = make_loop(tmp_path)
    for pool in ("prefill", "decode"):
        loop.report(pool, 2, 2)
    for step in range(6):
        source.reachable = step >= 3
        decisions = loop.step()
        for pool, target in decisions.targets().items():
            loop.report(pool, target, target)
        clock.now += 3
    recorded = json.loads((tmp_path / "rec.json").read_text())
    live = [d["targets"] for d in recorded["decisions"]]
    assert live[:3] == [{"prefill": 2, "decode": 2}] * 3  # held where Serve had them, not at min
    config, limits, steps = load_case(tmp_path / "rec.json")
    assert steps[0].observations is None and steps[0].serve_sizes == {"prefill": 2, "decode": 2}
    assert replay_targets(CoordinatedController(config, limits), steps) == live


def test_the_thread_decides_periodically_and_ends_when_serve_stops_asking():
    settings = settings_from_manifest(autoscaling_manifest(decision_interval_s=0.5, stale_after_s=5))
    source = FakeSource()
    loop = DecisionLoop(settings, source, orphan_after_s=1.5)
    loop.report("prefill", 1, 1)
    loop.report("decode", 1, 1)
    loop.start()
    deadline = time.monotonic() + 10
    while loop.running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not loop.running and len(loop.history) >= 1


def context(pool: str, target: int, running: int):
    return SimpleNamespace(deployment_name=pool, target_num_replicas=target, current_num_replicas=running,
                           policy_state={"kept": True})


def test_serve_policies_of_one_application_share_one_loop_and_a_redeploy_replaces_it():
    # Nothing listens on this port: the loop runs for real and holds ("unreachable").
    manifest = autoscaling_manifest(prometheus_url="http://127.0.0.1:9", decision_interval_s=0.5, stale_after_s=5)
    kwargs = {"settings": settings_from_manifest(manifest).to_json(), "record_path": None}
    prefill, decode = CoordinatedPoolPolicy(**kwargs), CoordinatedPoolPolicy(**kwargs)
    try:
        assert prefill(context("prefill", 1, 1)) == (1, {"kept": True})
        assert decode(context("decode", 1, 0)) == (1, {"kept": True})
        loop = prefill._loop
        assert loop is decode._loop and loop.running
        deadline = time.monotonic() + 10
        while not loop.history and time.monotonic() < deadline:
            time.sleep(0.1)
        observations, decisions = loop.history[-1].observations, loop.history[-1].decisions
        assert observations is None and decisions.held and decisions.targets() == {"prefill": 1, "decode": 1}

        changed = dict(kwargs, settings=settings_from_manifest(
            autoscaling_manifest(prometheus_url="http://127.0.0.1:9", decision_interval_s=1, stale_after_s=5)
        ).to_json())
        redeployed = CoordinatedPoolPolicy(**changed)
        redeployed(context("prefill", 1, 1))
        assert redeployed._loop is not loop
        deadline = time.monotonic() + 5
        while loop.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not loop.running  # the old application's controller was stopped
    finally:
        for loop in list(serve_loop._LOOPS.values()):
            loop.stop()
