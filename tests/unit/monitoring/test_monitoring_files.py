"""The committed monitoring files: generated from code, valid for promtool, structurally sound."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cluster.manifest import load_manifest
from monitoring import alerts, dashboard_variables, dashboards, prometheus_config, queries

REPO = Path(__file__).resolve().parents[3]
MONITORING = REPO / "monitoring"
LOCAL = load_manifest(REPO / "manifests" / "local.yaml")
PROMTOOL = shutil.which("promtool")


def test_committed_alert_rules_are_generated_from_the_local_manifest():
    assert (MONITORING / "prometheus" / "alerts.yml").read_text() == alerts.render(alerts.rules_for_manifest(LOCAL))


def test_committed_prometheus_config_is_generated():
    assert (MONITORING / "prometheus" / "prometheus.yml").read_text() == \
        prometheus_config.render(prometheus_config.prometheus_config())


@pytest.mark.skipif(PROMTOOL is None, reason="promtool comes with the prometheus package (scripts/setup.sh)")
def test_promtool_accepts_rules_and_config():
    for args in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"]):
        result = subprocess.run([PROMTOOL, *args], cwd=MONITORING / "prometheus", capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_cover_the_required_conditions():
    names = {rule.name for rule in alerts.alert_rules(2.0, 0.2)}
    assert {"MoeServeTTFTOverSLO", "MoeServeInterTokenLatencyOverSLO", "MoeServeKVTransferFailures",
            "MoeServeStuckKVLeases", "MoeServeReplicaRestarts", "MoeServeExpertLoadImbalance",
            "MoeServeMetricsStale"} <= names
    ttft = next(r for r in alerts.alert_rules(1.5, 0.05) if r.name == "MoeServeTTFTOverSLO")
    assert ttft.expr.endswith("> 1.5") and "time_to_first_token_seconds_bucket" in ttft.expr


@pytest.mark.parametrize("folder", ["dashboards", "provisioning/dashboards/moe-serve"])
def test_committed_dashboards_are_generated_from_code(folder):
    """Byte for byte what `python -m monitoring.dashboards` writes, and nothing else in the folder."""
    shared = dashboards.all_dashboards(LOCAL.slo.ttft_ms / 1e3, LOCAL.slo.itl_ms / 1e3)
    generated = shared if folder == "dashboards" else {
        name: dashboards.provisioned(board) for name, board in shared.items()}
    committed = {p.name: p.read_text() for p in (MONITORING / "grafana" / folder).glob("*.json")}
    assert committed == {name: dashboards.render(board) for name, board in generated.items()}


@pytest.mark.parametrize("name", sorted(dashboards.all_dashboards()))
def test_every_panel_has_the_datasource_variable_a_query_and_a_unit(name):
    board = dashboards.all_dashboards()[name]
    assert board["uid"].startswith("moe-serve-") and board["title"].startswith("moe-serve / ")
    known = {dashboard_variables.filtered(q.expr) for q in queries.ALL}
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"] in known, (panel["title"], target["expr"])
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


def test_grafana_provisioning_points_at_the_datasource_the_panels_use():
    datasources = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "datasources" / "moe-serve.yaml").read_text())
    assert [d["uid"] for d in datasources["datasources"]] == [dashboards.PROVISIONED_DATASOURCE["value"]]
    providers = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "dashboards" / "moe-serve.yaml").read_text())
    assert providers["providers"][0]["type"] == "file"
    # The provisioned copies default their datasource variable to that uid (no `__inputs` to resolve).
    for path in (MONITORING / "grafana" / "provisioning" / "dashboards" / "moe-serve").glob("*.json"):
        board = json.loads(path.read_text())
        assert "__inputs" not in board and "${DS_" not in path.read_text(), path.name
        variable = next(v for v in board["templating"]["list"] if v["type"] == "datasource")
        assert variable["current"]["value"] == datasources["datasources"][0]["uid"], path.name


def test_queries_name_only_catalogued_or_known_external_metrics():
    import re

    from monitoring.metrics import CATALOGUE, exposed_names

    ours = {f"ray_{name}" for metric in CATALOGUE for name in exposed_names(metric)}
    for query in queries.ALL:
        for name in re.findall(r"\bray_[a-z0-9_:]+", query.expr):
            assert name in ours or name.startswith(("ray_serve_", "ray_vllm_")), (query.key, name)
