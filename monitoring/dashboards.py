"""Grafana dashboards generated from code (grafana-foundation-sdk) out of the shared queries.

    .venv/bin/python -m monitoring.dashboards     # rewrites monitoring/grafana/dashboards/*.json

Dashboards: overview (traffic, latency percentiles against the SLO, goodput, phases), pools,
KV transfer, experts. Every panel uses the provisioned Prometheus datasource (uid below), one
or more queries from monitoring/queries.py and a unit; a unit test keeps the committed JSON
equal to what this module generates.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from grafana_foundation_sdk.builders.common import GraphThresholdsStyleConfig
from grafana_foundation_sdk.builders.dashboard import Dashboard, Row, ThresholdsConfig
from grafana_foundation_sdk.builders.prometheus import Dataquery as PrometheusQuery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import GraphTresholdsStyleMode  # sic: the SDK's spelling
from grafana_foundation_sdk.models.dashboard import DataSourceRef, Threshold, ThresholdsMode

from monitoring import queries as q

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "monitoring" / "grafana" / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="moe-serve-prometheus")


def _panel(title: str, *queries: q.Query, unit: str | None = None, width: int = 12,
           threshold: float | None = None) -> Timeseries:
    panel = Timeseries().title(title).datasource(DATASOURCE).unit(unit or queries[0].unit).span(width).height(8).min(0)
    for index, query in enumerate(queries):
        panel = panel.with_target(PrometheusQuery().expr(query.expr).legend_format(query.legend)
                                  .ref_id(chr(ord("A") + index)).datasource(DATASOURCE))
    if threshold is not None:  # the SLO target as a red line
        panel = panel.thresholds(ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps([
            Threshold(value=None, color="green"), Threshold(value=threshold, color="red")])
        ).thresholds_style(GraphThresholdsStyleConfig().mode(GraphTresholdsStyleMode.LINE))
    return panel


def _dashboard(uid: str, title: str) -> Dashboard:
    return (Dashboard(title).uid(uid).tags(["moe-serve", "generated"]).refresh("10s")
            .time("now-30m", "now").timezone("browser"))


def overview(ttft_slo_s: float, itl_slo_s: float) -> Dashboard:
    return (_dashboard("moe-serve-overview", "moe-serve / Overview")
            .with_row(Row("Traffic"))
            .with_panel(_panel("Requests by outcome", q.REQUEST_RATE))
            .with_panel(_panel("Goodput and generated tokens", q.GOODPUT, q.TOKEN_RATE, unit="short"))
            .with_row(Row("Latency against the SLO"))
            .with_panel(_panel("Time to first token", q.TTFT_P50, q.TTFT_P90, q.TTFT_P99, threshold=ttft_slo_s))
            .with_panel(_panel("Inter-token latency", q.TPOT_P50, q.TPOT_P90, q.TPOT_P99, threshold=itl_slo_s))
            .with_panel(_panel("End-to-end latency", q.E2E_P50, q.E2E_P99))
            .with_panel(_panel("SLO attainment", q.SLO_ATTAINMENT))
            .with_row(Row("Where the time goes"))
            .with_panel(_panel("Mean seconds per request phase", q.PHASE_MEAN))
            .with_panel(_panel("Request phases, p90", q.PHASE_P90)))


def pools() -> Dashboard:
    return (_dashboard("moe-serve-pools", "moe-serve / Prefill and decode pools")
            .with_panel(_panel("Requests in flight per engine", q.IN_FLIGHT))
            .with_panel(_panel("Healthy replicas", q.REPLICAS_HEALTHY))
            .with_panel(_panel("vLLM running and waiting", q.ENGINE_RUNNING, q.ENGINE_WAITING))
            .with_panel(_panel("Waiting in engine schedulers per pool", q.ENGINE_WAITING_BY_POOL))
            .with_panel(_panel("vLLM KV cache usage", q.KV_CACHE_USAGE))
            .with_panel(_panel("Queued at Serve handles", q.SERVE_QUEUED))
            .with_panel(_panel("Replica starts (10 min)", q.REPLICA_STARTS))
            .with_row(Row("Routing and admission"))
            .with_panel(_panel("Prompt tokens served from cache, and the router's expectation",
                               q.PROMPT_CACHE_HIT, q.ROUTER_EXPECTED_HIT))
            .with_panel(_panel("Routing decisions by reason", q.ROUTING_DECISION_RATE))
            .with_panel(_panel("Rejected by admission control (429)", q.ADMISSION_REJECTIONS)))


def kv_transfer() -> Dashboard:
    return (_dashboard("moe-serve-kv-transfer", "moe-serve / KV transfer")
            .with_panel(_panel("KV pulls", q.KV_PULL_RATE))
            .with_panel(_panel("KV bandwidth", q.KV_BANDWIDTH))
            .with_panel(_panel("Mean pull latency", q.KV_PULL_LATENCY))
            .with_panel(_panel("Prefill leases outstanding", q.KV_LEASES))
            .with_panel(_panel("Failures and fallbacks (10 min)", q.KV_FAILURES, q.KV_FALLBACKS))
            .with_panel(_panel("Expired (stuck) leases (10 min)", q.KV_LEASES_EXPIRED))
            .with_panel(_panel("KV pool hit rate", q.KV_POOL_HIT_RATE))
            .with_panel(_panel("KV pool bandwidth", q.KV_POOL_BANDWIDTH))
            .with_panel(_panel("KV pool time per block", q.KV_POOL_LATENCY))
            .with_panel(_panel("KV pool failures (10 min) and engines without it", q.KV_POOL_FAILURES,
                               q.KV_POOL_DOWN)))


def experts() -> Dashboard:
    return (_dashboard("moe-serve-experts", "moe-serve / Experts")
            .with_panel(_panel("Routed tokens per expert", q.EXPERT_LOAD))
            .with_panel(_panel("Routed tokens per rank", q.RANK_LOAD))
            .with_panel(_panel("Load imbalance (busiest / mean expert)", q.EXPERT_IMBALANCE, threshold=2.0))
            .with_panel(_panel("Requests routed to each rank", q.RANK_REQUESTS))
            .with_panel(_panel("Groups broken by a dead rank (10 min)", q.GROUP_FAILURES, width=24)))


def autoscaler(ttft_slo_s: float, itl_slo_s: float) -> Dashboard:
    """What the coordinated autoscaler decided, and the signals it decided from."""
    return (_dashboard("moe-serve-autoscaler", "moe-serve / autoscaler")
            .with_panel(_panel("Target vs current replicas (groups) per pool", q.AUTOSCALER_TARGETS,
                               q.AUTOSCALER_CURRENT, unit="short"))
            .with_panel(_panel("Healthy replicas", q.REPLICAS_HEALTHY))
            .with_panel(_panel("Scale-outs and scale-ins (10 min)", q.AUTOSCALER_ACTIONS))
            .with_panel(_panel("Holding: metrics unreachable or stale", q.AUTOSCALER_HOLDING))
            .with_panel(_panel("Input: time to first token p90 (prefill)", q.TTFT_P90, threshold=ttft_slo_s))
            .with_panel(_panel("Input: inter-token latency p90 (decode)", q.TPOT_P90, threshold=itl_slo_s))
            .with_panel(_panel("Input: requests waiting in engines per pool", q.ENGINE_WAITING_BY_POOL))
            .with_panel(_panel("Seconds since the latest decision", q.AUTOSCALER_DECISION_AGE)))


def all_dashboards(ttft_slo_s: float = 2.0, itl_slo_s: float = 0.2) -> dict[str, dict]:
    """File name -> dashboard JSON (as plain data)."""
    built = {"overview": overview(ttft_slo_s, itl_slo_s), "pools": pools(), "kv-transfer": kv_transfer(),
             "experts": experts(), "autoscaler": autoscaler(ttft_slo_s, itl_slo_s)}
    encoder = JSONEncoder(sort_keys=True, indent=2)
    return {f"moe-serve-{name}.json": json.loads(encoder.encode(board.build())) for name, board in built.items()}


def dashboard_queries(board: dict) -> list[tuple[str, str, str]]:
    """(panel title, unit, expr) of every target in a dashboard's JSON."""
    out = []
    for panel in board.get("panels", []):
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        for target in panel.get("targets", []):
            out.append((panel.get("title", ""), unit, target.get("expr", "")))
    return out


def main(argv: list[str] | None = None) -> int:
    from cluster.manifest import load_manifest

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", default=str(REPO / "manifests" / "local.yaml"))
    parser.add_argument("--out-dir", default=str(OUT_DIR))
    args = parser.parse_args(argv)
    manifest = load_manifest(args.manifest)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, board in all_dashboards(manifest.slo.ttft_ms / 1e3, manifest.slo.itl_ms / 1e3).items():
        (out / name).write_text(json.dumps(board, indent=2, sort_keys=True) + "\n")
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
