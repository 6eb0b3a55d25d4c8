"""Per-request records in, latency/throughput/goodput summary out. Pure: no I/O.

Definitions (all latencies from the moment the request was sent, `start_s`):
- TTFT: first token arrival - start.
- ITL: gap between consecutive token arrivals of one request, pooled over all
  successful requests. An arrival may carry several tokens (a streamed chunk), so
  this is the latency a streaming user sees between updates.
- Per-request mean ITL (used for goodput): (last arrival - first arrival) /
  (output_tokens - 1), i.e. the decode pace per token, which stays right even when
  chunks carry several tokens. Requests with <= 1 output token have no ITL and
  count as meeting the ITL SLO.
- E2E: end - start.
- Percentiles use linear interpolation between order statistics (numpy default).
- Failed requests are excluded from every latency and token figure but counted.
- Throughputs and goodput divide by the run's wall-clock `duration_s`.
- Goodput: successful requests with TTFT <= slo_ttft_ms AND mean ITL <= slo_itl_ms,
  per second.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass
class RequestRecord:
    """What happened to one request. Times are seconds from the start of the run."""

    request_id: int
    scheduled_s: float  # when the trace said to send it
    start_s: float  # when it was actually sent
    end_s: float
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # one entry per arrival
    prompt_tokens: int = 0  # server-reported when available, else approximate
    output_tokens: int = 0
    ok: bool = False
    error: str | None = None

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_s is None:
            return None
        return (self.first_token_s - self.start_s) * 1000.0

    @property
    def e2e_ms(self) -> float:
        return (self.end_s - self.start_s) * 1000.0

    @property
    def itl_gaps_ms(self) -> list[float]:
        times = self.token_times_s
        return [(b - a) * 1000.0 for a, b in zip(times, times[1:])]

    @property
    def mean_itl_ms(self) -> float | None:
        if self.output_tokens <= 1 or len(self.token_times_s) < 1:
            return None
        decode_s = self.token_times_s[-1] - self.token_times_s[0]
        return decode_s * 1000.0 / (self.output_tokens - 1)


@dataclass(frozen=True)
class Percentiles:
    """Latency distribution in milliseconds; NaN when there were no samples."""

    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    count: int

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> Percentiles:
        if len(samples_ms) == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan, 0)
        arr = np.asarray(samples_ms, dtype=float)
        p50, p90, p99 = np.percentile(arr, [50, 90, 99], method="linear")
        return cls(float(arr.mean()), float(p50), float(p90), float(p99), len(arr))


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_ok: int
    num_failed: int
    num_slo_met: int
    duration_s: float
    slo_ttft_ms: float
    slo_itl_ms: float
    request_throughput_rps: float
    output_throughput_tps: float  # output tokens per second, successful requests only
    goodput_rps: float
    total_prompt_tokens: int
    total_output_tokens: int
    ttft: Percentiles
    itl: Percentiles  # gaps between chunk arrivals (a chunk may carry several tokens)
    tpot: Percentiles  # per request: decode time / (output tokens - 1), i.e. time per output token
    e2e: Percentiles
    errors: dict[str, int]  # error message -> count, for a quick look at failures

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: NaN (no samples) becomes None."""
        return _nan_to_none(asdict(self))


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def meets_slo(record: RequestRecord, slo_ttft_ms: float, slo_itl_ms: float) -> bool:
    ttft_ms = record.ttft_ms
    if not record.ok or ttft_ms is None or ttft_ms > slo_ttft_ms:
        return False
    mean_itl_ms = record.mean_itl_ms
    return mean_itl_ms is None or mean_itl_ms <= slo_itl_ms


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float,
    slo_itl_ms: float,
) -> Summary:
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    errors: dict[str, int] = {}
    for r in failed:
        key = r.error or "unknown error"
        errors[key] = errors.get(key, 0) + 1
    num_slo_met = sum(meets_slo(r, slo_ttft_ms, slo_itl_ms) for r in ok)
    total_output = sum(r.output_tokens for r in ok)

    def per_s(x: float) -> float:
        return x / duration_s if duration_s > 0 else float("nan")

    return Summary(
        num_requests=len(records),
        num_ok=len(ok),
        num_failed=len(failed),
        num_slo_met=num_slo_met,
        duration_s=duration_s,
        slo_ttft_ms=slo_ttft_ms,
        slo_itl_ms=slo_itl_ms,
        request_throughput_rps=per_s(len(ok)),
        output_throughput_tps=per_s(total_output),
        goodput_rps=per_s(num_slo_met),
        total_prompt_tokens=sum(r.prompt_tokens for r in ok),
        total_output_tokens=total_output,
        ttft=Percentiles.of([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        itl=Percentiles.of([gap for r in ok for gap in r.itl_gaps_ms]),
        tpot=Percentiles.of([r.mean_itl_ms for r in ok if r.mean_itl_ms is not None]),
        e2e=Percentiles.of([r.e2e_ms for r in ok]),
        errors=errors,
    )


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


# (row label, how to read it from a Summary), in table order.
_TABLE_ROWS: list[tuple[str, Any]] = [
    ("requests ok / failed", lambda s: f"{s.num_ok} / {s.num_failed}"),
    ("duration (s)", lambda s: _fmt(s.duration_s, 2)),
    ("request throughput (req/s)", lambda s: _fmt(s.request_throughput_rps, 2)),
    ("output throughput (tok/s)", lambda s: _fmt(s.output_throughput_tps, 1)),
    (
        "goodput (req/s)",
        lambda s: f"{_fmt(s.goodput_rps, 2)} ({s.num_slo_met}/{s.num_requests})",
    ),
    ("SLO TTFT / ITL (ms)", lambda s: f"{_fmt(s.slo_ttft_ms, 0)} / {_fmt(s.slo_itl_ms, 0)}"),
] + [
    (f"{name} {stat} (ms)", lambda s, a=attr, f=stat: _fmt(getattr(getattr(s, a), f"{f}_ms")))
    for name, attr in (("TTFT", "ttft"), ("ITL", "itl"), ("TPOT", "tpot"), ("E2E", "e2e"))
    for stat in ("p50", "p90", "p99")
]


def format_table(rows: Sequence[tuple[str, Summary]]) -> str:
    """Markdown table: one column per labelled summary, one row per metric."""
    header = ["metric"] + [label for label, _ in rows]
    body = [[name] + [get(s) for _, s in rows] for name, get in _TABLE_ROWS]
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [cells[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(cells[1:], widths[1:])
        ]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(
        "-" * (widths[0] + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)
    ) + "|"
    return "\n".join([line(header), rule] + [line(cells) for cells in body])
