"""Phase accounting (pure) and what the ingress records per request (with a fake Ray metrics backend)."""

from __future__ import annotations

import pytest

from deployments.records import EngineTiming, TokenDelta
from monitoring.metrics import CATALOGUE, Kind, Phase, exposed_names
from monitoring.phases import RequestMarks, request_phases, server_timing
from tests.unit.ingress_fakes import FakeEngine, FakeMetricsBackend, HELLO, MODEL, make_client


def test_disaggregated_phases_partition_the_end_to_end_latency():
    marks = RequestMarks(received=10.0, dispatched=10.01, prefill_done=10.21, first_token=10.50,
                         last_token=11.50, done=11.51)
    phases = request_phases(marks, queue_s=0.05, first_token_s=0.20, disaggregated=True)
    assert phases == pytest.approx({Phase.ingress: 0.01, Phase.prefill: 0.20, Phase.queue: 0.05,
                                    Phase.kv_transfer: 0.20, Phase.dispatch: 0.04, Phase.inter_token: 1.0,
                                    Phase.finish: 0.01})
    assert sum(phases.values()) == pytest.approx(marks.done - marks.received)


def test_colocated_phases_name_the_engine_part_prompt_compute():
    marks = RequestMarks(received=0.0, dispatched=0.002, first_token=0.3, last_token=0.9, done=0.9)
    phases = request_phases(marks, queue_s=0.1, first_token_s=0.15, disaggregated=False)
    assert Phase.prefill not in phases and Phase.kv_transfer not in phases
    assert phases[Phase.first_token_compute] == pytest.approx(0.15)
    assert sum(phases.values()) == pytest.approx(0.9)


def test_without_engine_timing_the_engine_share_stays_in_dispatch():
    marks = RequestMarks(received=0.0, dispatched=0.01, first_token=0.5, last_token=0.5, done=0.6)
    phases = request_phases(marks, None, None, disaggregated=False)
    assert phases[Phase.dispatch] == pytest.approx(0.49) and Phase.queue not in phases
    assert sum(phases.values()) == pytest.approx(0.6)


def test_engine_reporting_more_than_the_ingress_saw_shows_up_as_an_excess_not_a_negative_phase():
    marks = RequestMarks(received=0.0, dispatched=0.0, first_token=0.1, last_token=0.2, done=0.2)
    phases = request_phases(marks, queue_s=0.2, first_token_s=0.2, disaggregated=False)
    assert min(phases.values()) >= 0
    assert sum(phases.values()) > 0.2  # the integration test's 5% check catches such clocks


def test_server_timing_header_lists_phases_and_total_in_ms():
    text = server_timing({Phase.ingress: 0.0012, Phase.inter_token: 0.5}, 0.6)
    assert text == "ingress;dur=1.20, inter_token;dur=500.00, total;dur=600.00"


def test_catalogue_names_follow_prometheus_conventions():
    names = [metric.name for metric in CATALOGUE]
    assert len(names) == len(set(names))
    for metric in CATALOGUE:
        assert metric.name.startswith("moe_serve_")
        assert metric.name.endswith("_total") == (metric.kind is Kind.counter), metric.name
        if metric.kind is Kind.histogram:
            # A unit in the name: seconds, or a ratio (a share between 0 and 1).
            assert metric.name.endswith(("_seconds", "_ratio")) and list(metric.buckets) == sorted(metric.buckets)
            assert exposed_names(metric)[0].endswith("_bucket")
        assert "request_id" not in metric.labels  # unbounded label sets are forbidden
    # Ray exports a counter also as a gauge under its name without `_total`: that name must not
    # be another metric's family name (a counter named like a histogram is silently lost).
    families = {metric.name for metric in CATALOGUE if metric.kind is not Kind.counter}
    for metric in CATALOGUE:
        if metric.kind is Kind.counter:
            assert metric.name[: -len("_total")] not in families, metric.name


def test_a_served_request_records_outcome_latencies_phases_and_tokens():
    backend = FakeMetricsBackend()
    timed = [TokenDelta("Hi", [10], None, 3, 1, engine_timing=EngineTiming(0.0, 0.0)),
             TokenDelta(" there", [11], "length", 3, 2)]
    client, _ = make_client(FakeEngine(script=timed), backend)
    response = client.post("/v1/completions", json={"model": MODEL["name"], "prompt": "hello", "max_tokens": 2})
    assert response.status_code == 200
    timing = response.headers["Server-Timing"]
    assert "queue;dur=0.00" in timing and "first_token_compute;dur=0.00" in timing and "total;dur=" in timing
    assert backend.values("moe_serve_requests", route="completions", outcome="ok") == [1.0]
    phases = {t["phase"]: v for kind, n, v, t in backend.records if n == "moe_serve_request_phase_seconds"}
    (e2e,) = backend.values("moe_serve_request_e2e_seconds", route="completions")
    assert sum(phases.values()) == pytest.approx(e2e, rel=1e-6)
    assert backend.values("moe_serve_generation_tokens", route="completions") == [2]
    assert len(backend.values("moe_serve_time_to_first_token_seconds")) == 1
    assert len(backend.values("moe_serve_time_per_output_token_seconds")) == 1


def test_each_request_records_the_share_of_its_prompt_it_reused_by_whether_it_named_its_session():
    backend = FakeMetricsBackend()
    cached = [TokenDelta("Hi", [10], None, 8, 1, cached_tokens=6), TokenDelta(" there", [11], "length", 8, 2)]
    client, _ = make_client(FakeEngine(script=cached), backend)
    body = {"model": MODEL["name"], "prompt": "hello", "max_tokens": 2}
    assert client.post("/v1/completions", json=body, headers={"X-Session-Id": "agent-1"}).status_code == 200
    assert backend.values("moe_serve_prompt_reuse_ratio", session="yes") == [0.75]
    assert client.post("/v1/completions", json=body).status_code == 200
    assert backend.values("moe_serve_prompt_reuse_ratio", session="no") == [0.75]


def test_bad_requests_and_streams_count_their_outcome():
    backend = FakeMetricsBackend()
    client, _ = make_client(FakeEngine(script=HELLO), backend)
    assert client.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
    with client.stream("POST", "/v1/completions", json={"model": MODEL["name"], "prompt": "x", "max_tokens": 3,
                                                         "stream": True}) as response:
        assert response.status_code == 200
        list(response.iter_lines())
    assert backend.values("moe_serve_requests", outcome="client_error") == [1.0]
    assert backend.values("moe_serve_requests", outcome="ok") == [1.0]
