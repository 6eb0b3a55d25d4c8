"""Grafana dashboards generated from code (grafana-foundation-sdk) out of the shared queries.

    .venv/bin/python -m monitoring.dashboards     # rewrites both sets of JSON below

Dashboards: overview (traffic, latency percentiles against the SLO, goodput, phases), pools,
KV transfer, experts, autoscaler. Every panel has one or more queries from
monitoring/queries.py, narrowed by the `pool` and `model` variables where their series carry
those labels (monitoring/dashboard_variables.py), and a unit. Two copies of each:

- monitoring/grafana/dashboards/: to import into any Grafana (Dashboards > Import). Panels,
  targets and query variables read `${datasource}`; `__inputs` asks for a Prometheus
  (DS_PROMETHEUS, as Grafana's export for sharing does) and makes it the variable's default.
- monitoring/grafana/provisioning/dashboards/moe-serve/: for file provisioning, which does
  not resolve `__inputs`: the same dashboards with the variable defaulting to the provisioned
  datasource (uid moe-serve-prometheus).

A unit test keeps the committed JSON equal to what this module generates.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from monitoring import dashboard_variables as dv
from monitoring import queries as q
from monitoring.extras import MissingExtraError

try:
    from grafana_foundation_sdk.builders.common import GraphThresholdsStyleConfig
    from grafana_foundation_sdk.builders.dashboard import (Dashboard, DatasourceVariable, QueryVariable, Row,
                                                           ThresholdsConfig)
    from grafana_foundation_sdk.builders.prometheus import Dataquery as PrometheusQuery
    from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.common import GraphTresholdsStyleMode  # sic: the SDK's spelling
    from grafana_foundation_sdk.models.dashboard import (DataSourceRef, Threshold, ThresholdsMode, VariableOption,
                                                         VariableRefresh, VariableSort)
except ImportError as exc:
    raise MissingExtraError("the dashboard generator (monitoring.dashboards)", "dashboards",
                            "grafana-foundation-sdk") from exc

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "monitoring" / "grafana" / "dashboards"
PROVISIONED_DIR = REPO / "monitoring" / "grafana" / "provisioning" / "dashboards" / "moe-serve"
# Panels, targets and query variables name the datasource variable, never a datasource.
DATASOURCE = DataSourceRef(type_val="prometheus", uid=f"${{{dv.DATASOURCE}}}")
# What Grafana's import asks for (Dashboards > Import), as its export for sharing writes it; the
# import replaces ${DS_PROMETHEUS} with the chosen datasource, which the variable then defaults to.
INPUTS = [{"name": "DS_PROMETHEUS", "label": "Prometheus", "description": "The Prometheus that scrapes the Ray "
           "cluster's metrics endpoints", "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}]
# schemaVersion 36 is Grafana 9.0's; later versions migrate it on load.
REQUIRES = [{"type": "grafana", "id": "grafana", "name": "Grafana", "version": "9.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""}]
# The datasource monitoring/grafana/provisioning/datasources/moe-serve.yaml provisions.
PROVISIONED_DATASOURCE = {"text": "moe-serve Prometheus", "value": "moe-serve-prometheus"}


def _panel(title: str, *queries: q.Query, unit: str | None = None, width: int = 12,
           threshold: float | None = None) -> Timeseries:
    panel = Timeseries().title(title).datasource(DATASOURCE).unit(unit or queries[0].unit).span(width).height(8).min(0)
    for index, query in enumerate(queries):
        panel = panel.with_target(PrometheusQuery().expr(dv.filtered(query.expr)).legend_format(query.legend)
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
            .with_panel(_panel("KV pool loads from the disk tier", q.KV_POOL_DISK_SHARE))
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


def _datasource_variable() -> DatasourceVariable:
    # id = name: Grafana keys variables by id, and the SDK's default gives every variable one zero uuid.
    return (DatasourceVariable(dv.DATASOURCE).id(dv.DATASOURCE).label("Data source").type("prometheus")
            .current(VariableOption(text="Prometheus", value="${DS_PROMETHEUS}")))


def _query_variable(variable: dv.QueryVariable) -> QueryVariable:
    return (QueryVariable(variable.name).id(variable.name).label(variable.label).datasource(DATASOURCE)
            .query(variable.query).refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.ALPHABETICAL_ASC)
            .multi(True).include_all(True).all_value(dv.ALL_VALUE)
            .current(VariableOption(text=["All"], value=["$__all"])))


def _encode(board: Dashboard) -> dict:
    return json.loads(JSONEncoder(sort_keys=True).encode(board.build()))


def shareable(board: Dashboard) -> dict:
    """The dashboard's JSON for import into any Grafana: the datasource variable, the `pool` and
    `model` variables its queries filter on, `__inputs` and `__requires`, numbered panels."""
    board = copy.deepcopy(board)  # the builder appends variables in place
    used = set().union(*(dv.referenced(expr) for _, _, expr in dashboard_queries(_encode(board))))
    board = board.with_variable(_datasource_variable())
    for variable in dv.QUERY_VARIABLES:
        if variable.name in used:
            board = board.with_variable(_query_variable(variable))
    data = _encode(board)
    for panel_id, panel in enumerate(data["panels"], start=1):  # unique ids, as Grafana's export has
        panel["id"] = panel_id
    return {"__inputs": copy.deepcopy(INPUTS), "__requires": copy.deepcopy(REQUIRES), **data}


def provisioned(shared: dict) -> dict:
    """The same dashboard for file provisioning, which does not resolve `__inputs`: the datasource
    variable defaults to the provisioned datasource instead."""
    board = {key: value for key, value in copy.deepcopy(shared).items() if key not in ("__inputs", "__requires")}
    for variable in board["templating"]["list"]:
        if variable["type"] == "datasource":
            variable["current"] = dict(PROVISIONED_DATASOURCE)
    return board


def all_dashboards(ttft_slo_s: float = 2.0, itl_slo_s: float = 0.2) -> dict[str, dict]:
    """File name -> dashboard JSON for import (as plain data); `provisioned()` gives the other copy."""
    built = {"overview": overview(ttft_slo_s, itl_slo_s), "pools": pools(), "kv-transfer": kv_transfer(),
             "experts": experts(), "autoscaler": autoscaler(ttft_slo_s, itl_slo_s)}
    return {f"moe-serve-{name}.json": shareable(board) for name, board in built.items()}


def dashboard_queries(board: dict) -> list[tuple[str, str, str]]:
    """(panel title, unit, expr) of every target in a dashboard's JSON."""
    out = []
    for panel in board.get("panels", []):
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        for target in panel.get("targets", []):
            out.append((panel.get("title", ""), unit, target.get("expr", "")))
    return out


def render(board: dict) -> str:
    """A dashboard's JSON as the committed files hold it."""
    return json.dumps(board, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    from cluster.manifest import load_manifest

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", default=str(REPO / "manifests" / "local.yaml"))
    parser.add_argument("--out-dir", default=str(OUT_DIR), help="the dashboards for import")
    parser.add_argument("--provisioned-dir", default=str(PROVISIONED_DIR), help="the copies for file provisioning")
    args = parser.parse_args(argv)
    manifest = load_manifest(args.manifest)
    for name, board in all_dashboards(manifest.slo.ttft_ms / 1e3, manifest.slo.itl_ms / 1e3).items():
        for out, data in ((Path(args.out_dir), board), (Path(args.provisioned_dir), provisioned(board))):
            out.mkdir(parents=True, exist_ok=True)
            (out / name).write_text(render(data))
            print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
