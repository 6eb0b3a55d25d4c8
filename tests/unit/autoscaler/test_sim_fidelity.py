"""The simulator-error benchmark's pure helpers: calibration fit, trace conversion, statistics."""

from __future__ import annotations

import math

import pytest

from autoscaler.baselines import FixedSplit
from autoscaler.service_model import CPU_TINY_MODEL
from autoscaler.simulator import SimConfig, SimPool, simulate
from benchmarks.loadgen.stats import RequestRecord
from benchmarks.sim_fidelity import (DecodeProbe, PrefillProbe, fit_service_model, latency_summary, relative_error,
                                     sim_summary, trace_from_records)


def _lone_ttft(model, prompt_tokens: int) -> float:
    """What the simulator predicts for a lone request: the relation the fit inverts."""
    return model.prefill_s(prompt_tokens) + model.kv_transfer_s(prompt_tokens) + model.decode_step_s(1)


def test_fit_recovers_the_model_that_produced_the_probes():
    truth = CPU_TINY_MODEL.__class__(**{**CPU_TINY_MODEL.__dict__, "prefill_base_s": 0.05,
                                        "prefill_s_per_token": 0.8e-3, "decode_base_s": 0.030,
                                        "decode_per_seq_s": 0.004})
    prefill = [PrefillProbe(tokens, _lone_ttft(truth, tokens)) for tokens in (100, 500, 1500)]
    decode = [DecodeProbe(1, truth.decode_step_s(1)), DecodeProbe(8, truth.decode_step_s(8))]
    fitted = fit_service_model(CPU_TINY_MODEL, prefill, decode, max_batch=64)
    assert fitted.prefill_base_s == pytest.approx(0.05, rel=1e-6)
    assert fitted.prefill_s_per_token == pytest.approx(0.8e-3, rel=1e-6)
    assert fitted.decode_base_s == pytest.approx(0.030, rel=1e-6)
    assert fitted.decode_per_seq_s == pytest.approx(0.004, rel=1e-6)
    assert fitted.max_batch == 64 and fitted.kv_capacity_tokens == CPU_TINY_MODEL.kv_capacity_tokens
    # And the simulator, driven by the fitted model, reproduces a lone request's TTFT.
    assert _lone_ttft(fitted, 700) == pytest.approx(_lone_ttft(truth, 700), rel=1e-6)


def test_fit_needs_two_prompt_lengths_and_two_batch_sizes():
    with pytest.raises(ValueError, match="two prompt lengths"):
        fit_service_model(CPU_TINY_MODEL, [PrefillProbe(100, 0.1)] * 3, [DecodeProbe(1, 0.03), DecodeProbe(8, 0.04)])
    with pytest.raises(ValueError, match="batch 1"):
        fit_service_model(CPU_TINY_MODEL, [PrefillProbe(100, 0.1), PrefillProbe(900, 0.4)], [DecodeProbe(8, 0.04)])


def _record(rid: int, scheduled: float, ttft: float, itl: float, prompt: int, output: int, ok: bool = True):
    start = scheduled + 0.001
    times = [start + ttft + i * itl for i in range(output)]
    return RequestRecord(rid, scheduled, start, times[-1], times[0], times, prompt, output, ok,
                         None if ok else "boom")


def test_records_become_a_trace_and_statistics_match_on_both_sides():
    records = [_record(i, i * 0.5, ttft=0.1 * (i + 1), itl=0.02, prompt=100 + i, output=10) for i in range(10)]
    records.append(_record(10, 5.0, ttft=9.0, itl=0.02, prompt=100, output=10, ok=False))
    trace = trace_from_records("t", records)
    assert len(trace) == 10 and trace.prompt_tokens.tolist() == [100 + i for i in range(10)]
    assert trace.arrival_s.tolist() == [i * 0.5 for i in range(10)] and set(trace.output_tokens.tolist()) == {10}

    real = latency_summary(records, ttft_slo_s=0.55, itl_slo_s=0.05)
    assert real.ttft_p50_s == pytest.approx(0.55) and real.itl_p50_s == pytest.approx(0.02)
    assert real.slo_attainment == pytest.approx(5 / 11)  # the failed request counts as missed

    report = simulate(SimConfig(prefill=SimPool("prefill", 1), decode=SimPool("decode", 1), model=CPU_TINY_MODEL,
                                cluster_units=2.0, ttft_slo_s=0.55, itl_slo_s=0.05), trace, FixedSplit())
    sim = sim_summary(report, trace)
    # Sparse arrivals on an unloaded model: TTFT is a lone request's, ITL one decode step or so.
    assert sim.ttft_p50_s == pytest.approx(_lone_ttft(CPU_TINY_MODEL, 105), rel=0.05)
    assert CPU_TINY_MODEL.decode_step_s(1) * 0.99 <= sim.itl_p50_s <= CPU_TINY_MODEL.decode_step_s(2) * 1.01
    assert sim.output_tps == pytest.approx(100 / (report.end_s - 0.0))


def test_relative_error():
    assert relative_error(1.5, 1.0) == pytest.approx(0.5)
    assert relative_error(0.5, 1.0) == pytest.approx(-0.5)
    assert math.isnan(relative_error(1.0, 0.0))
