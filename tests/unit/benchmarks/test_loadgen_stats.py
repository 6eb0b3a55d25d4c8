"""Summary statistics: percentiles, ITL, goodput, failure handling, output formats."""

import json
import math

import pytest

from benchmarks.loadgen.stats import (
    Percentiles,
    RequestRecord,
    format_table,
    meets_slo,
    summarize,
)


def rec(
    start_s: float,
    token_times_s: list[float],
    end_s: float | None = None,
    *,
    output_tokens: int | None = None,
    ok: bool = True,
    error: str | None = None,
    request_id: int = 0,
) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        scheduled_s=start_s,
        start_s=start_s,
        end_s=end_s if end_s is not None else (token_times_s[-1] if token_times_s else start_s),
        first_token_s=token_times_s[0] if token_times_s else None,
        token_times_s=list(token_times_s),
        prompt_tokens=10,
        output_tokens=len(token_times_s) if output_tokens is None else output_tokens,
        ok=ok,
        error=error,
    )


def test_percentiles_linear_interpolation_on_known_data():
    p = Percentiles.of([float(x) for x in range(1, 101)])  # 1..100
    assert p.p50_ms == pytest.approx(50.5)
    assert p.p90_ms == pytest.approx(90.1)
    assert p.p99_ms == pytest.approx(99.01)
    assert p.mean_ms == pytest.approx(50.5)
    assert p.count == 100
    two = Percentiles.of([10.0, 20.0])
    assert two.p50_ms == pytest.approx(15.0)
    assert two.p90_ms == pytest.approx(19.0)


def test_empty_percentiles_are_nan():
    p = Percentiles.of([])
    assert math.isnan(p.p50_ms) and p.count == 0


def test_ttft_itl_e2e_and_throughput():
    records = [
        # TTFT 100 ms, gaps 50 / 50 ms, e2e 250 ms
        rec(0.0, [0.1, 0.15, 0.2], end_s=0.25, request_id=0),
        # TTFT 300 ms, gaps 100 / 200 ms, e2e 700 ms
        rec(1.0, [1.3, 1.4, 1.6], end_s=1.7, request_id=1),
    ]
    s = summarize(records, duration_s=2.0, slo_ttft_ms=1e9, slo_itl_ms=1e9)
    assert (s.num_requests, s.num_ok, s.num_failed) == (2, 2, 0)
    assert s.ttft.p50_ms == pytest.approx(200.0)
    assert s.ttft.count == 2
    assert sorted([50.0, 50.0, 100.0, 200.0]) == pytest.approx(
        sorted(g for r in records for g in r.itl_gaps_ms)
    )
    assert s.itl.p50_ms == pytest.approx(75.0)
    assert s.itl.count == 4
    assert s.e2e.p50_ms == pytest.approx(475.0)
    assert s.request_throughput_rps == pytest.approx(1.0)
    assert s.output_throughput_tps == pytest.approx(3.0)
    assert s.total_output_tokens == 6


def test_mean_itl_is_per_token_even_with_multi_token_chunks():
    # Two arrivals 400 ms apart carrying 5 tokens: 4 gaps worth of decode -> 100 ms.
    r = rec(0.0, [0.1, 0.5], output_tokens=5)
    assert r.mean_itl_ms == pytest.approx(100.0)
    assert r.itl_gaps_ms == pytest.approx([400.0])
    # A single output token has no ITL, so only TTFT decides its SLO.
    one = rec(0.0, [0.1])
    assert one.mean_itl_ms is None
    assert meets_slo(one, slo_ttft_ms=200, slo_itl_ms=1)
    assert not meets_slo(one, slo_ttft_ms=50, slo_itl_ms=1)


def test_goodput_counts_only_requests_meeting_both_slos():
    slo_ttft_ms, slo_itl_ms = 200.0, 50.0
    records = [
        rec(0.0, [0.1, 0.14, 0.18], request_id=0),  # TTFT 100, ITL 40: meets both
        rec(0.0, [0.3, 0.34, 0.38], request_id=1),  # TTFT 300: misses TTFT
        rec(0.0, [0.1, 0.2, 0.3], request_id=2),  # ITL 100: misses ITL
        rec(0.0, [0.5, 0.7, 0.9], request_id=3),  # misses both
        # Fast but failed: must never count toward goodput.
        rec(0.0, [0.01, 0.02], ok=False, error="HTTP 500", request_id=4),
        rec(0.0, [0.2, 0.25, 0.3], request_id=5),  # exactly on both limits: meets
    ]
    s = summarize(records, duration_s=4.0, slo_ttft_ms=slo_ttft_ms, slo_itl_ms=slo_itl_ms)
    assert s.num_slo_met == 2
    assert s.goodput_rps == pytest.approx(0.5)
    assert s.request_throughput_rps == pytest.approx(5 / 4.0)


def test_failed_requests_excluded_from_latency_but_counted():
    good = [rec(0.0, [0.1, 0.2], request_id=i) for i in range(3)]
    failed = [
        rec(0.0, [5.0, 9.0], end_s=30.0, ok=False, error="timeout after 30 s", request_id=10),
        rec(0.0, [], end_s=0.01, ok=False, error="HTTP 500: boom", request_id=11),
        rec(0.0, [], end_s=0.01, ok=False, error="HTTP 500: boom", request_id=12),
    ]
    s = summarize(good + failed, duration_s=1.0, slo_ttft_ms=1000, slo_itl_ms=1000)
    assert (s.num_requests, s.num_ok, s.num_failed) == (6, 3, 3)
    assert s.ttft.p99_ms == pytest.approx(100.0)
    assert s.e2e.p99_ms == pytest.approx(200.0)
    assert s.itl.count == 3
    assert s.total_output_tokens == 6
    assert s.errors == {"timeout after 30 s": 1, "HTTP 500: boom": 2}


def test_to_dict_is_strict_json_even_without_successes():
    s = summarize([rec(0.0, [], ok=False, error="x")], 1.0, 100, 10)
    d = s.to_dict()
    assert d["ttft"]["p50_ms"] is None
    assert d["num_failed"] == 1
    json.dumps(d, allow_nan=False)  # raises if any NaN slipped through


def test_format_table_side_by_side():
    a = summarize([rec(0.0, [0.1, 0.2], request_id=0)], 1.0, 1000, 1000)
    b = summarize(
        [rec(0.0, [0.3, 0.6], request_id=0), rec(0.0, [], ok=False, error="e", request_id=1)],
        2.0,
        1000,
        1000,
    )
    table = format_table([("baseline", a), ("candidate", b)])
    lines = table.splitlines()
    assert "baseline" in lines[0] and "candidate" in lines[0]
    assert len({len(line) for line in lines}) == 1  # aligned columns
    ttft_row = next(line for line in lines if line.startswith("| TTFT p50"))
    assert [c.strip() for c in ttft_row.strip("|").split("|")][1:] == ["100.0", "300.0"]
    ok_row = next(line for line in lines if line.startswith("| requests ok"))
    assert "1 / 0" in ok_row and "1 / 1" in ok_row
