"""Render the key panels to PNG straight from Prometheus, for people who want to look, not query.

    moe-serve report --since 10m --out report/      # one PNG per panel plus overview.png

Uses the same queries as the Grafana dashboards (monitoring/queries.py). Draws with matplotlib,
from the `report` extra.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from monitoring import queries as q
from monitoring.extras import MissingExtraError
from monitoring.prometheus_api import PrometheusAPI


@dataclass(frozen=True)
class ReportPanel:
    name: str
    title: str
    queries: tuple[q.Query, ...]
    slo_s: float | None = None


def report_panels(ttft_slo_s: float, itl_slo_s: float) -> list[ReportPanel]:
    return [
        ReportPanel("traffic", "Requests per second by outcome", (q.REQUEST_RATE,)),
        ReportPanel("ttft", "Time to first token (s)", (q.TTFT_P50, q.TTFT_P90, q.TTFT_P99), ttft_slo_s),
        ReportPanel("itl", "Inter-token latency (s)", (q.TPOT_P50, q.TPOT_P90, q.TPOT_P99), itl_slo_s),
        ReportPanel("goodput", "Goodput (req/s within SLO) and tokens/s", (q.GOODPUT, q.TOKEN_RATE)),
        ReportPanel("phases", "Mean seconds per request phase", (q.PHASE_MEAN,)),
        ReportPanel("in_flight", "Requests in flight per engine", (q.IN_FLIGHT,)),
        ReportPanel("kv_bandwidth", "KV bytes pulled per second", (q.KV_BANDWIDTH,)),
        ReportPanel("experts", "Routed tokens per second per expert", (q.EXPERT_LOAD,)),
    ]


def parse_duration(text: str) -> float:
    """'90s', '10m', '2h' -> seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smh])", text.strip())
    if not match:
        raise ValueError(f"duration {text!r}: use a number with s, m or h (e.g. 10m)")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[match.group(2)]


def _legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def render_report(api: PrometheusAPI, out_dir: Path, *, since_s: float, ttft_slo_s: float, itl_slo_s: float,
                  now_s: float | None = None) -> list[Path]:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingExtraError("`moe-serve report`", "report", "matplotlib") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = now_s if now_s is not None else time.time()
    start = end - since_s
    step = max(since_s / 240, 1.0)
    out_dir.mkdir(parents=True, exist_ok=True)
    panels = report_panels(ttft_slo_s, itl_slo_s)
    written: list[Path] = []
    overview, axes = plt.subplots(4, 2, figsize=(16, 18))
    for panel, overview_ax in zip(panels, axes.flat):
        figure, ax = plt.subplots(figsize=(8, 4))
        for target in (ax, overview_ax):
            drawn = 0
            for query in panel.queries:
                for series in api.query_range(query.expr, start, end, step):
                    if not series.points:
                        continue
                    xs = [(t - end) / 60 for t, _ in series.points]
                    target.plot(xs, [v for _, v in series.points], label=_legend(query.legend, series.labels))
                    drawn += 1
            if panel.slo_s is not None:
                target.axhline(panel.slo_s, color="red", linestyle="--", label="SLO")
            if not drawn:
                target.text(0.5, 0.5, "no data in this window", ha="center", va="center", transform=target.transAxes)
            target.set_title(panel.title)
            target.set_xlabel("minutes before now")
            target.grid(alpha=0.3)
            if drawn or panel.slo_s is not None:
                target.legend(fontsize="small", loc="upper left")
        path = out_dir / f"{panel.name}.png"
        figure.tight_layout()
        figure.savefig(path, dpi=90)
        plt.close(figure)
        written.append(path)
    overview.suptitle(f"moe-serve, last {since_s / 60:g} minutes")
    overview.tight_layout()
    path = out_dir / "overview.png"
    overview.savefig(path, dpi=70)
    plt.close(overview)
    written.append(path)
    return written
