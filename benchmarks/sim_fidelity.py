"""How far the autoscaler simulator is from a real run: pure helpers for bench_sim_fidelity.

Three steps, all on plain data:
1. `fit_service_model`: calibrate a ServiceModel from isolated probe requests on the real stack.
   The simulator's TTFT of a lone request is
       prefill_s(P) + kv_transfer_s(P) + decode_step_s(1)
   (see autoscaler/sim_decode.py), so a least-squares line through (prompt tokens, TTFT) gives
   prefill_s_per_token = slope - kv_transfer_s_per_token and
   prefill_base_s = intercept - decode_step_s(1): HTTP, ingress and Serve routing end up in the
   fixed part, where a real client sees them too. The decode step is the median per-request
   inter-token latency of a lone request (batch 1) and of `batch` requests decoding together.
2. `trace_from_records`: the very requests the real run sent (arrival, server-counted prompt
   and output tokens) as a simulator Trace.
3. `latency_summary` / `relative_error`: the same statistics on both sides (per-request TTFT
   and mean ITL percentiles, output tokens/s, SLO attainment).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autoscaler.service_model import ServiceModel
from autoscaler.traces import Trace


@dataclass(frozen=True)
class PrefillProbe:
    prompt_tokens: int
    ttft_s: float  # of a lone request, as the client saw it


@dataclass(frozen=True)
class DecodeProbe:
    batch: int  # requests decoding together
    itl_s: float  # median of their per-request mean inter-token latency


def fit_service_model(base: ServiceModel, prefill: Sequence[PrefillProbe], decode: Sequence[DecodeProbe],
                      **overrides) -> ServiceModel:
    """`base` with prefill and decode timing fitted to probes; other fields kept or overridden."""
    if len({p.prompt_tokens for p in prefill}) < 2:
        raise ValueError("need prefill probes of at least two prompt lengths to fit a line")
    batches = {p.batch for p in decode}
    if 1 not in batches or len(batches) < 2:
        raise ValueError("need decode probes at batch 1 and at one larger batch")
    slope, intercept = np.polyfit([p.prompt_tokens for p in prefill], [p.ttft_s for p in prefill], 1)
    step_1 = statistics.median(p.itl_s for p in decode if p.batch == 1)
    per_seq = statistics.median((p.itl_s - step_1) / (p.batch - 1) for p in decode if p.batch > 1)
    per_seq = max(per_seq, 0.0)  # a busy machine can make batch 1 look slower than batch N
    decode_base = max(step_1 - per_seq, 1e-4)
    return dataclasses.replace(
        base, name=f"{base.name}-fitted",
        prefill_s_per_token=max(float(slope) - base.kv_transfer_s_per_token, 0.0),
        prefill_base_s=max(float(intercept) - (decode_base + per_seq), 0.0),
        decode_base_s=decode_base, decode_per_seq_s=per_seq, **overrides)


def trace_from_records(name: str, records: Sequence) -> Trace:
    """Records (benchmarks.loadgen RequestRecord) of one run, as the simulator's Trace."""
    sent = sorted((r for r in records if r.ok), key=lambda r: r.scheduled_s)
    if not sent:
        raise ValueError("no successful request to build a trace from")
    arrival = np.array([r.scheduled_s for r in sent], dtype=np.float64)
    return Trace(name, duration_s=float(arrival[-1]) + 1e-9, arrival_s=arrival,
                 prompt_tokens=np.array([r.prompt_tokens for r in sent], dtype=np.int64),
                 output_tokens=np.array([max(r.output_tokens, 1) for r in sent], dtype=np.int64))


@dataclass(frozen=True)
class LatencySummary:
    ttft_p50_s: float
    ttft_p90_s: float
    itl_p50_s: float  # of per-request mean inter-token latency
    itl_p90_s: float
    output_tps: float  # output tokens / (first arrival .. last finish)
    slo_attainment: float

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


METRICS: tuple[tuple[str, str, float], ...] = (  # (field, label, display scale)
    ("ttft_p50_s", "TTFT p50 (ms)", 1e3), ("ttft_p90_s", "TTFT p90 (ms)", 1e3),
    ("itl_p50_s", "ITL p50 (ms)", 1e3), ("itl_p90_s", "ITL p90 (ms)", 1e3),
    ("output_tps", "output tok/s", 1.0), ("slo_attainment", "SLO attainment", 100.0),
)


def latency_summary(records: Sequence, ttft_slo_s: float, itl_slo_s: float) -> LatencySummary:
    """Of a real run: the same statistics the simulator reports, from the client's records."""
    ok = [r for r in records if r.ok]
    if not ok:
        raise ValueError("no successful request to summarize")
    ttft = np.array([r.ttft_ms / 1e3 for r in ok])
    itl = np.array([(r.mean_itl_ms or 0.0) / 1e3 for r in ok])  # None: one token, no ITL
    span_s = max(r.end_s for r in ok) - min(r.scheduled_s for r in records)
    met = int(np.sum((ttft <= ttft_slo_s) & (itl <= itl_slo_s)))
    return LatencySummary(float(np.percentile(ttft, 50)), float(np.percentile(ttft, 90)),
                          float(np.percentile(itl, 50)), float(np.percentile(itl, 90)),
                          sum(r.output_tokens for r in ok) / span_s, met / len(records))


def sim_summary(report, trace: Trace) -> LatencySummary:
    """Of a simulator report on `trace` (starts at its first arrival, like the real run)."""
    span_s = report.end_s - float(trace.arrival_s[0])
    return LatencySummary(report.ttft_p50_s, report.ttft_p90_s, report.itl_p50_s, report.itl_p90_s,
                          float(trace.output_tokens.sum()) / span_s, report.slo_attainment)


def relative_error(simulated: float, real: float) -> float:
    """(sim - real) / real; NaN when the real value is zero (no scale to compare on)."""
    return (simulated - real) / real if real else math.nan
