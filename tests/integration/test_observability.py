"""Observability on the real stack: a real Prometheus (started with the session's cluster, so it
has scraped every earlier test's traffic and failures) evaluates every PromQL expression of the
dashboards and alert rules, request phases add up to end-to-end latency, and alerts fire.

Runs last (file order): it relies on what earlier modules provoked (a killed rank, injected
transfer failures, aborts) and provokes the rest itself (an expired lease, fresh traffic).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.prompt_set import COMPLETION_PROMPTS

pytestmark = pytest.mark.integration


def _api(stack):
    from monitoring.prometheus_api import PrometheusAPI

    return PrometheusAPI(stack.prometheus_url)


def _drive_traffic(stack, n: int = 12) -> list[httpx.Response]:
    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            completions = [client.post(f"{stack.base_url}/v1/completions", json={
                "model": stack.model, "prompt": COMPLETION_PROMPTS["short"] + f" {i}", "max_tokens": 24,
                "temperature": 0}) for i in range(n)]
            chats = [client.post(f"{stack.base_url}/v1/chat/completions", json={
                "model": stack.model, "messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 8})
                for i in range(2)]
            return await asyncio.gather(*completions, *chats)

    return asyncio.run(run())


@pytest.fixture(scope="module")
def background_traffic(stack):
    """A trickle of requests for the whole module: vLLM's gauges are only recorded while its
    engines step, and a series that leaves a scrape is stale to Prometheus at once."""
    import threading

    stop = threading.Event()

    def trickle():
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                try:
                    client.post(f"{stack.base_url}/v1/completions", json={
                        "model": stack.model, "prompt": "keep the engines stepping", "max_tokens": 16})
                except httpx.HTTPError:
                    pass
                stop.wait(0.5)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    yield stop  # set it to stop the trickle early
    stop.set()
    thread.join(timeout=70)


@pytest.fixture(scope="module")
def observed(stack, background_traffic):
    """Traffic, an injected transfer failure and an expired lease, then enough scrapes."""
    from ray import serve

    from cluster.manifest import load_manifest
    from deployments.records import EngineRequest, SamplingSpec

    manifest = load_manifest(stack.manifest_path)
    # A prefill nobody pulls: its lease must run to its deadline (the stuck-lease signal).
    prefill = serve.get_deployment_handle("prefill", app_name=stack.app_name)
    result = prefill.prefill.remote(EngineRequest("orphan-prefill", list(range(3, 200)),
                                                  SamplingSpec(max_tokens=1))).result(timeout_s=60)
    assert result.transfer_params.remote_request_id
    expires_at = time.monotonic() + manifest.kv_transfer.lease_s
    responses = _drive_traffic(stack)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    httpx.post(f"{stack.base_url}/v1/completions", headers={"X-Moe-Serve-Inject-KV-Failure": "1"}, timeout=60,
               json={"model": stack.model, "prompt": COMPLETION_PROMPTS["long"], "max_tokens": 4})
    time.sleep(max(expires_at - time.monotonic(), 0) + 2)
    _drive_traffic(stack, n=4)  # the engines' periodic exports run while requests flow
    time.sleep(12)  # export period (5 s) + scrape interval (2 s) + evaluation, with margin
    return responses


def test_every_dashboard_and_alert_query_returns_data(stack, observed):
    from monitoring import dashboard_variables as dv
    from monitoring.alerts import alert_rules
    from monitoring.dashboards import all_dashboards, dashboard_queries
    from monitoring.queries import ALL, AUTOSCALER, GROUP_FAILURES, KV_POOL_DOWN

    # The autoscaler's series exist only while an autoscaling manifest runs: the autoscaler
    # module (test_autoscaler_stack.py) checks those expressions.
    later = {query.expr for query in AUTOSCALER}
    # The pool's health gauge exists only while an application with a KV pool runs (the
    # session's default application has none): test_kv_pool_stack.py checks that query.
    later.add(KV_POOL_DOWN.expr)
    # A group's failure counter exists once a rank has died: the expert-group failure module
    # (extended tier) kills one and checks that query.
    later.add(GROUP_FAILURES.expr)
    later |= {dv.filtered(expr) for expr in later}  # as the dashboards hold them
    # The panels' variables as Grafana substitutes them. `.+` rather than "All" (`.*`): a series
    # lacking the label a variable filters would then have no data, so this also proves that
    # every filter names a label its series carries.
    values = {dv.DATASOURCE: "unused in PromQL"} | {variable.name: ".+" for variable in dv.QUERY_VARIABLES}
    expressions = {query.expr: query.key for query in ALL if query.expr not in later}
    for name, board in all_dashboards().items():
        for title, _unit, expr in dashboard_queries(board):
            if expr not in later:
                expressions.setdefault(dv.substitute(expr, values), f"{name}: {title}")
        # Each of the dashboard's query variables offers values (Grafana's label_values).
        for variable in board["templating"]["list"]:
            if variable["type"] == "query":
                known = next(v for v in dv.QUERY_VARIABLES if v.name == variable["name"])
                assert variable["query"] == known.query
                expressions.setdefault(f'count by ({known.label_name}) ({known.values_of}{{{known.label_name}!=""}})',
                                       f"{name}: variable {known.name}")
    for rule in alert_rules(2.0, 0.2):
        if rule.query.expr not in later:
            expressions.setdefault(rule.query.expr, rule.name)
    api = _api(stack)
    # Each query must answer at least once within the window, not all in one poll: vLLM's own
    # gauges (requests running and waiting) leave the nodes' metrics endpoints for ~10 s at a
    # time while an engine idles (watched on a node's endpoint every 5 s, 2026-12-06), and an
    # instant query finds nothing during such a gap.
    empty = dict(expressions)  # expression -> what shows it
    deadline = time.monotonic() + 45
    while True:
        empty = {expr: key for expr, key in empty.items() if not api.query(expr)}
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(3)
    assert not empty, "queries without data:\n" + "\n".join(f"{k}: {e}" for e, k in empty.items())


def test_provoked_alerts_fire(stack, observed):
    """The test Prometheus runs the real rules with an impossible TTFT target; an orphaned
    prefill's lease expired; an earlier module killed a rank of an expert-parallel group."""
    api = _api(stack)
    wanted = {"MoeServeTTFTOverSLO", "MoeServeStuckKVLeases", "MoeServeKVTransferFailures"}
    deadline = time.monotonic() + 40
    firing: set[str] = set()
    while time.monotonic() < deadline and not wanted <= firing:
        firing = {a["labels"]["alertname"] for a in api.alerts() if a["state"] == "firing"}
        time.sleep(2)
    assert wanted <= firing, firing
    # Healthy signals stay quiet.
    assert "MoeServeMetricsTargetDown" not in firing and "MoeServeMetricsStale" not in firing


def test_vllm_and_serve_metrics_come_through_the_same_scrape(stack, observed):
    api = _api(stack)
    # Ray exports each metric on its own few-second timer, and on a loaded box a scrape can miss
    # one gauge for a while (seen in CI: replica_healthy absent once): poll before judging.
    deadline = time.monotonic() + 30
    while True:
        names = {s.labels["__name__"] for s in api.query('count by (__name__) ({__name__=~"ray_(vllm|serve)_.+"})')}
        found = any(n.startswith("ray_vllm_") for n in names) and "ray_serve_deployment_replica_healthy" in names
        if found or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert any(n.startswith("ray_vllm_") for n in names), sorted(names)[:20]
    assert "ray_serve_deployment_replica_healthy" in names


def test_report_renders_the_key_panels_to_png(stack, observed, tmp_path):
    from cluster.cli import main

    assert main(["report", "--prometheus", stack.prometheus_url, "--since", "5m", "--out", str(tmp_path)]) == 0
    pngs = {p.name: p.read_bytes() for p in tmp_path.glob("*.png")}
    assert {"overview.png", "ttft.png", "itl.png", "phases.png", "kv_bandwidth.png", "experts.png"} <= set(pngs)
    for name, data in pngs.items():
        assert data.startswith(b"\x89PNG") and len(data) > 10_000, name


def test_request_phases_add_up_to_end_to_end_latency(stack, observed, background_traffic):
    """Per request from its Server-Timing header, and over every request from Prometheus.
    Last in the file: it stops the background traffic to compare settled totals."""
    for response in observed:
        timings = dict(part.split(";dur=") for part in response.headers["Server-Timing"].split(", "))
        total = float(timings.pop("total"))
        phases = {name: float(ms) for name, ms in timings.items()}
        assert {"ingress", "prefill", "queue", "kv_transfer", "dispatch", "inter_token", "finish"} <= set(phases)
        assert sum(phases.values()) == pytest.approx(total, rel=0.05), timings
    # Ray exports each metric every few seconds, not in step with the others: stop the traffic
    # and let two export intervals and a scrape pass before comparing the exact counters.
    background_traffic.set()
    time.sleep(25)
    api = _api(stack)
    phase_total = api.query("sum(ray_moe_serve_request_phase_time_seconds_total)")[0].value
    e2e_total = api.query("sum(ray_moe_serve_request_time_seconds_total)")[0].value
    per_phase = {s.labels["phase"]: round(s.value, 2) for s in api.query(
        "sum by (phase) (ray_moe_serve_request_phase_time_seconds_total)")}
    assert phase_total == pytest.approx(e2e_total, rel=0.05), (e2e_total, per_phase)
    # The histograms carry every request's every always-present phase once.
    counts = {s.labels.get("phase", "e2e"): s.value for s in api.query(
        "sum by (phase) (ray_moe_serve_request_phase_seconds_count) or sum(ray_moe_serve_request_e2e_seconds_count)")}
    assert len({counts[k] for k in ("e2e", "ingress", "dispatch", "inter_token", "finish")}) == 1, counts
