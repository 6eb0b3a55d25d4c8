"""The coordinated autoscaler on the real stack: Serve's controller runs our policy, which reads a
real Prometheus scraping the real engines, and Serve adds and removes real vLLM replicas.

One scenario, in order (the steps build on each other, like the load they model):
1. the session's application is redeployed from manifests/local-autoscaling.yaml as Ray users
   deploy (`moe-serve build` writes a Serve config file, Ray's `serve deploy` applies it), reading
   its own Prometheus, which this module can stop; it serves what one plain engine serves; that
   Prometheus is down when the decision loop starts: the loop holds Serve's sizes until it is up;
2. low load: nothing moves;                                           (2-4: extended tier)
3. a step to high load of long prompts: prefill's queue and TTFT breach, prefill (and only
   prefill) scales out, and Serve starts the second engine;
4. back to low load: prefill scales in after its cooldown, never flapping;
5. Prometheus stops: the autoscaler holds every pool and says why (log, metric, recording);
   it restarts: decisions resume;
6. the live decision log replays to the same decisions through a fresh controller;
7. left idle, prefill (min_replicas 0) scales to zero; the next request waits at the ingress
   while prefill wakes up, and gets its answer (not a 503); the autoscaler's dashboard and
   alert queries have data.

Runs last (file order): it changes the session's application.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests import metrics_text
from tests.integration.conftest import (REPO, TEST_HTTP_PORT, TEST_METRICS_BASE, _log, deploy_config_file,
                                        deployed_app_config)
from tests.prompt_set import COMPLETION_PROMPTS, MAX_TOKENS

pytestmark = pytest.mark.integration

AUTOSCALER_PROMETHEUS_PORT = 9392
# The Serve controller (where the autoscaler runs) lives on the head node: node 0's metrics port.
HEAD_METRICS_URL = f"http://127.0.0.1:{TEST_METRICS_BASE}/metrics"
LONG_PROMPT = "lorem ipsum dolor " * 100  # ~1,400 tokens: a few fill a CPU prefill step
SCALE_TO_ZERO_IDLE_S = 30


@dataclass
class Autoscaled:
    prometheus: object
    record_path: Path
    app: str
    model: str
    base_url: str
    scale_out_cooldown_s: float
    scale_in_cooldown_s: float
    low_load: "Load | None" = None
    blind_start: tuple = ()  # (decisions, replica samples) while its Prometheus was down at start

    def decisions(self) -> list[dict]:
        try:
            return json.loads(self.record_path.read_text())["decisions"]
        except (OSError, ValueError, KeyError):  # not written yet
            return []

    def wait_for(self, what: str, predicate, timeout_s: float, poll_s: float = 1.0):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            result = predicate()
            if result:
                return result
            time.sleep(poll_s)
        last = self.decisions()[-3:]
        raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}; last decisions: {last}")


class Load:
    """Closed-loop clients: each sends its next request when the previous one finished."""

    def __init__(self, stack: Autoscaled, clients: int, prompt: str, max_tokens: int, pause_s: float = 0.0):
        self._stop = threading.Event()
        self.statuses: list[int] = []
        self._threads = [threading.Thread(target=self._client, args=(stack, i, prompt, max_tokens, pause_s),
                                          daemon=True) for i in range(clients)]

    def _client(self, stack: Autoscaled, index: int, prompt: str, max_tokens: int, pause_s: float) -> None:
        with httpx.Client(timeout=120) as client:
            sent = 0
            while not self._stop.is_set():
                try:
                    response = client.post(f"{stack.base_url}/v1/completions", json={
                        "model": stack.model, "prompt": f"{index} {sent} {prompt}", "max_tokens": max_tokens})
                    self.statuses.append(response.status_code)
                except httpx.HTTPError:
                    self.statuses.append(0)
                sent += 1
                self._stop.wait(pause_s)

    def __enter__(self) -> "Load":
        for thread in self._threads:
            if thread.ident is None:  # entering a load that is already running keeps it running
                thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=130)


class ReplicaSampler:
    """Serve's running replicas per pool, sampled every second (what the actuator achieved)."""

    def __init__(self, app: str):
        self.app, self.samples = app, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from ray import serve

        while not self._stop.is_set():
            try:
                deployments = serve.status().applications[self.app].deployments
                self.samples.append((time.monotonic(), {name: dep.replica_states.get("RUNNING", 0)
                                                        for name, dep in deployments.items()}))
            except Exception:  # a status call during a redeploy: try again
                pass
            self._stop.wait(1.0)

    def running(self, pool: str) -> int:
        return self.samples[-1][1].get(pool, 0) if self.samples else 0

    def __enter__(self) -> "ReplicaSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture(scope="module")
def autoscaled(stack, tmp_path_factory):
    from cluster.manifest import load_manifest
    from monitoring.alerts import rules_for_manifest
    from monitoring.local_prometheus import LocalPrometheus

    work = tmp_path_factory.mktemp("autoscaler")
    data = yaml.safe_load((REPO / "manifests" / "local-autoscaling.yaml").read_text())
    data["http"]["port"] = TEST_HTTP_PORT
    # Prefill is the pool this scenario overloads (prompts piling up in its engine, TTFT);
    # targets this generous keep what the two shared cores do to latency at low load (TTFT of a
    # short prompt up to ~2 s, ITL ~0.5 s) from reading as a breach, or from never reading as calm.
    data["slo"] = {"ttft_ms": 4000, "itl_ms": 5000}
    data["autoscaling"].update(prometheus_url=f"http://127.0.0.1:{AUTOSCALER_PROMETHEUS_PORT}",
                               record_path=str(work / "decisions.json"), metrics_window_s=15,
                               scale_to_zero_idle_s=SCALE_TO_ZERO_IDLE_S)
    prefill_pool = next(pool for pool in data["pools"] if pool["role"] == "prefill")
    prefill_pool["autoscaling"]["min_replicas"] = 0  # idle prefill may go to zero (the last test)
    manifest_path = work / "local-autoscaling-test.yaml"
    manifest_path.write_text(yaml.safe_dump(data))
    manifest = load_manifest(manifest_path)
    # This module runs last and needs no other Prometheus: two scraping at once (plus the engines,
    # Ray's agents and the load) starve two cores until scrapes and queries time out.
    stack.prometheus.stop()
    prometheus = LocalPrometheus(port=AUTOSCALER_PROMETHEUS_PORT, scrape_interval_s=2.0, workdir=work / "prometheus",
                                 rules=rules_for_manifest(manifest))
    started = time.monotonic()
    # As Ray users deploy: `moe-serve build` writes a Serve config, Ray's `serve deploy` applies it
    # (Serve's build task runs our application builder); the autoscaler must decide from it.
    # Its Prometheus is not up yet: a decision loop that starts blind must hold Serve's sizes.
    _log("redeploying with autoscaling through `moe-serve build` + `serve deploy` (its Prometheus down)")
    deploy_config_file(stack.dashboard_url, manifest_path, work)
    deployed_at = time.time()
    _log(f"redeployed in {time.monotonic() - started:.0f}s")
    scaled = Autoscaled(prometheus, work / "decisions.json", manifest.name, manifest.model.name, stack.base_url,
                        manifest.autoscaling.scale_out_cooldown_s, manifest.autoscaling.scale_in_cooldown_s)
    # The low load of the scenario's first step starts as soon as the application runs: prefill
    # (min_replicas 0) would otherwise count as idle from its first ready decision, and on a
    # loaded box the wait below plus the rate window's lag reached SCALE_TO_ZERO_IDLE_S in CI.
    scaled.low_load = Load(scaled, clients=1, prompt="hello", max_tokens=8, pause_s=1.0).__enter__()
    with ReplicaSampler(manifest.name) as replicas:
        scaled.wait_for("three decisions while Prometheus is down", lambda: len(scaled.decisions()) >= 3,
                        timeout_s=90)
    scaled.blind_start = (scaled.decisions(), replicas.samples)
    try:
        prometheus.start(progress=_log)
        # Idle engines export from their first health check, so decisions start without traffic.
        scaled.wait_for("a decision on the new engines' metrics, every replica ready", lambda: any(
            d["at_s"] > deployed_at and not d["held"] and not any("starting" in r for r in d["reasons"].values())
            for d in scaled.decisions()), timeout_s=180)
        yield scaled
    finally:
        scaled.low_load.__exit__(None, None, None)
        prometheus.stop()


def _changes(decisions: list[dict], pool: str) -> list[tuple[float, int, int]]:
    """(at_s, from, to) for every decision that changed the pool's target."""
    out, previous = [], None
    for decision in decisions:
        target = decision["targets"][pool]
        if previous is not None and target != previous:
            out.append((decision["at_s"], previous, target))
        previous = target
    return out


def _last_drop_to_zero(decisions: list[dict], pool: str) -> dict | None:
    """The latest decision that took `pool` from running replicas to zero. Later decisions say
    "idle at zero" (the loop keeps deciding while the test polls), so the latest decision at zero
    is not the one that scaled it there."""
    return next((d for before, d in reversed(list(zip(decisions, decisions[1:])))
                 if before["targets"][pool] > 0 and d["targets"][pool] == 0), None)


def test_the_config_deployed_application_serves_plain_vllm_outputs(autoscaled, reference_outputs):
    config = deployed_app_config(autoscaled.app)
    assert config is not None, "the application was not deployed from a config file"
    assert config["import_path"] == "deployments.config_app:build_from_args"
    for name in sorted(COMPLETION_PROMPTS):
        body = {"model": autoscaled.model, "prompt": COMPLETION_PROMPTS[name], "max_tokens": MAX_TOKENS,
                "temperature": 0, "return_token_ids": True}
        response = httpx.post(f"{autoscaled.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["token_ids"] == reference_outputs[name]["token_ids"], name
        assert choice["text"] == reference_outputs[name]["text"], name


def test_a_loop_that_starts_with_prometheus_down_holds_serves_sizes(autoscaled):
    decisions, samples = autoscaled.blind_start
    assert decisions and samples
    for decision in decisions:
        assert decision["held"], decision
        # Serve's sizes (one engine each), not the bounds' minimum (prefill may go to zero).
        assert decision["targets"] == {"prefill": 1, "decode": 1}, decision
    assert all(sample == {**sample, "prefill": 1, "decode": 1} for _t, sample in samples), samples


# Extended tier (docs/testing.md): ~7 minutes of CI, most of it a second prefill engine starting on
# two cores that the load keeps busy. The default tier still sees the loop scale a pool on real
# Prometheus data through Serve, both ways: to zero when idle and back on the next request.
@pytest.mark.extended
def test_load_step_scales_the_right_pool_out_then_in_without_flapping(autoscaled):
    with ReplicaSampler(autoscaled.app) as replicas:
        # 1. Low load (running since the deploy): a short request now and then. Nothing moves.
        with autoscaled.low_load as low:
            time.sleep(12)  # six decisions
            assert all(d["targets"] == {"prefill": 1, "decode": 1} for d in autoscaled.decisions()), \
                autoscaled.decisions()[-3:]

            # 2. High load: eight clients sending ~1,400-token prompts back to back: they pile up
            # inside the one prefill engine (running over its capacity of 2) and wait (TTFT).
            with Load(autoscaled, clients=8, prompt=LONG_PROMPT, max_tokens=4) as high:
                out = autoscaled.wait_for("prefill to scale out", lambda: next(
                    (d for d in autoscaled.decisions() if d["targets"]["prefill"] == 2), None), timeout_s=120)
                _log(f"scale-out decision: {out['reasons']['prefill']}")
                # An engine starting on two cores that the load keeps busy: 240 s was not enough
                # on a slow CI machine.
                autoscaled.wait_for("Serve to run the second prefill engine",
                                    lambda: replicas.running("prefill") == 2, timeout_s=420)
            assert set(high.statuses) == {200}, sorted(set(high.statuses))

            # 3. Low load again: prefill comes back to one engine after its cooldown.
            autoscaled.wait_for("prefill to scale back in", lambda: autoscaled.decisions()[-1]["targets"]["prefill"]
                                == 1, timeout_s=180)
            autoscaled.wait_for("Serve to stop the second prefill engine",
                                lambda: replicas.running("prefill") == 1, timeout_s=60)
        assert set(low.statuses) == {200}, sorted(set(low.statuses))

    decisions = autoscaled.decisions()
    prefill = _changes(decisions, "prefill")
    # On failure, say why each change was made: a flap is only fixable with its reasons.
    why = [(at, before, after, next(d["reasons"] for d in decisions if d["at_s"] == at))
           for at, before, after in prefill]
    assert [(before, after) for _at, before, after in prefill] == [(1, 2), (2, 1)], why
    # Only prefill was short of capacity: decode never moved.
    assert _changes(decisions, "decode") == []
    assert re.search(r"scale out: .*(running|queue|ttft)", out["reasons"]["prefill"]), out["reasons"]["prefill"]
    scale_in = next(d for d in decisions if d["at_s"] == prefill[1][0])
    assert scale_in["reasons"]["prefill"].startswith("scale in: calm"), scale_in["reasons"]["prefill"]
    # The replica count changes direction at most once per cooldown window.
    assert prefill[1][0] - prefill[0][0] >= autoscaled.scale_in_cooldown_s
    # What Serve ran followed the decisions: 1, then 2, then 1 prefill engines.
    running = [sample["prefill"] for _t, sample in replicas.samples if "prefill" in sample]
    directions = [b - a for a, b in zip(running, running[1:]) if b != a]
    assert directions == [1, -1], running


def _head_metric(name: str, **labels: str) -> float | None:
    found = metrics_text.samples(httpx.get(HEAD_METRICS_URL, timeout=10).text, name, **labels)
    return found[0].value if found else None


def test_stopping_prometheus_makes_the_autoscaler_hold_and_say_so(autoscaled):
    from monitoring.prometheus_api import PrometheusAPI

    autoscaled.prometheus.stop()
    stopped_at = time.time()
    try:
        held = autoscaled.wait_for("a held decision after Prometheus stopped", lambda: next(
            (d for d in autoscaled.decisions() if d["at_s"] > stopped_at and d["held"]), None), timeout_s=30)
        assert all("metrics source unreachable" in reason for reason in held["reasons"].values()), held
        before = [d for d in autoscaled.decisions() if d["at_s"] < held["at_s"]]
        assert before and held["targets"] == before[-1]["targets"]  # holds where it is
        # The Serve controller's own metrics endpoint says so (Prometheus itself is down).
        autoscaled.wait_for("the holding metric", lambda: _head_metric(
            "ray_moe_serve_autoscaler_holding", reason="unreachable") == 1.0, timeout_s=60)
    finally:  # the next tests need it back, whatever happened here
        autoscaled.prometheus.start(progress=_log)
    restarted_at = time.time()
    autoscaled.wait_for("decisions to resume", lambda: next(
        (d for d in autoscaled.decisions() if d["at_s"] > restarted_at and not d["held"]), None), timeout_s=60)
    # The restarted Prometheus has the series once it has scraped the head node (every 2 s, its
    # targets found through Ray's service-discovery file): wait for that, not for one query.
    api = PrometheusAPI(autoscaled.prometheus.url)
    samples = autoscaled.wait_for("the holding series in the restarted Prometheus",
                                  lambda: api.query("ray_moe_serve_autoscaler_holding"), timeout_s=60)
    holding = {s.labels["reason"]: s.value for s in samples}
    assert holding.get("unreachable") in (0.0, 1.0)  # exported with its reason label


def test_the_live_decision_log_replays_to_the_same_decisions(autoscaled):
    from autoscaler.controller import CoordinatedController
    from autoscaler.replay import load_case, replay_targets

    config, limits, steps = load_case(autoscaled.record_path)
    live = [d["targets"] for d in json.loads(autoscaled.record_path.read_text())["decisions"]]
    assert len(steps) == len(live) > 20
    # The loop started blind (its Prometheus down): those steps replay only with Serve's sizes.
    assert steps[0].observations is None and steps[0].serve_sizes
    assert replay_targets(CoordinatedController(config, limits), steps) == live


def test_idle_prefill_goes_to_zero_and_the_next_request_waits_for_it_to_wake(autoscaled):
    from monitoring.prometheus_api import PrometheusAPI
    from monitoring.queries import AUTOSCALER

    autoscaled.low_load.__exit__(None, None, None)  # idle from here (the load step stopped it already)
    with ReplicaSampler(autoscaled.app) as replicas:
        asleep = autoscaled.wait_for("prefill to scale to zero when idle", lambda: _last_drop_to_zero(
            autoscaled.decisions(), "prefill"), timeout_s=SCALE_TO_ZERO_IDLE_S + 120)
        assert "scale to zero" in asleep["reasons"]["prefill"], asleep["reasons"]
        assert asleep["targets"]["decode"] == 1  # decode's min_replicas is 1
        autoscaled.wait_for("Serve to stop the prefill engine", lambda: replicas.samples and replicas.running(
            "prefill") == 0, timeout_s=60)

        sent = time.time()
        started = time.monotonic()
        response = httpx.post(f"{autoscaled.base_url}/v1/completions", timeout=600, json={
            "model": autoscaled.model, "prompt": "wake up", "max_tokens": 4})
        _log(f"first request after scale to zero answered in {time.monotonic() - started:.0f}s")
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"]
    woke = next(d for d in autoscaled.decisions() if d["at_s"] > sent and d["targets"]["prefill"] == 1)
    assert woke["reasons"]["prefill"].startswith("waking from zero"), woke["reasons"]
    # The autoscaler dashboard's and alert rules' own queries have data in the Prometheus that was
    # restarted above; the scale-in to zero and the wake are the scaling actions in the last 10 min.
    api = PrometheusAPI(autoscaled.prometheus.url)
    autoscaled.wait_for("every autoscaler query to have data",
                        lambda: all(api.query(query.expr) for query in AUTOSCALER), timeout_s=60)
