"""The generated dashboards import into any Grafana: datasource variable, `__inputs`, `__requires`,
and `pool`/`model` variables that filter only series carrying the label they filter on."""

from __future__ import annotations

import json
import re

import pytest

from monitoring import dashboard_variables as dv
from monitoring import dashboards, queries
from monitoring.metrics import CATALOGUE, exposed_names

BOARDS = dashboards.all_dashboards()
NAMES = sorted(BOARDS)
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
# Variables Grafana defines itself.
BUILTIN = {"__interval", "__interval_ms", "__range", "__range_s", "__range_ms", "__rate_interval", "__all"}
CATALOGUE_LABELS = {f"ray_{name}": metric.labels for metric in CATALOGUE for name in exposed_names(metric)}


def _variables(board: dict) -> dict[str, dict]:
    return {variable["name"]: variable for variable in board["templating"]["list"]}


def _exprs(board: dict) -> list[str]:
    return [expr for _, _, expr in dashboards.dashboard_queries(board)]


@pytest.mark.parametrize("name", NAMES)
def test_inputs_ask_for_one_prometheus_the_way_grafanas_export_does(name):
    board = BOARDS[name]
    [source] = board["__inputs"]
    assert {key: value for key, value in source.items() if key != "description"} == {
        "name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource", "pluginId": "prometheus",
        "pluginName": "Prometheus"}
    assert isinstance(source["description"], str)
    text = json.dumps(board)
    # Every ${DS_...} the import replaces is declared, and the input is used: the datasource
    # variable defaults to whatever Prometheus the importer picks.
    assert set(re.findall(r"\$\{(DS_\w+)\}", text)) == {"DS_PROMETHEUS"}
    assert _variables(board)["datasource"]["current"]["value"] == "${DS_PROMETHEUS}"
    # No datasource of ours is named anywhere.
    assert "moe-serve-prometheus" not in text


@pytest.mark.parametrize("name", NAMES)
def test_requires_name_grafana_the_prometheus_plugin_and_every_panel_type(name):
    board = BOARDS[name]
    required = {(item["type"], item["id"]) for item in board["__requires"]}
    assert {("grafana", "grafana"), ("datasource", "prometheus")} <= required
    assert all({"type", "id", "name", "version"} <= set(item) for item in board["__requires"])
    panel_types = {panel["type"] for panel in board["panels"]} - {"row"}
    assert {("panel", kind) for kind in panel_types} <= required


@pytest.mark.parametrize("name", NAMES)
def test_the_datasource_variable_is_defined_and_everything_queries_through_it(name):
    board = BOARDS[name]
    variables = _variables(board)
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus" and source["id"] == "datasource"
    assert board["templating"]["list"][0] is source  # first: the others query through it
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE_REF, variable["name"]
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == DATASOURCE_REF, panel["title"]
            assert all(target["datasource"] == DATASOURCE_REF for target in panel["targets"]), panel["title"]
    ids = [panel["id"] for panel in board["panels"]]
    assert len(set(ids)) == len(ids) and all(isinstance(i, int) and i > 0 for i in ids)


@pytest.mark.parametrize("name", NAMES)
def test_panel_queries_use_exactly_the_variables_the_dashboard_defines(name):
    board = BOARDS[name]
    variables = _variables(board)
    used = set().union(*(dv.referenced(expr) for expr in _exprs(board)))
    undefined = used - set(variables) - BUILTIN
    assert not undefined, undefined
    # A `pool` or `model` control that no panel follows would mislead: only those used are shown.
    assert {v for v, d in variables.items() if d["type"] == "query"} == used & {v.name for v in dv.QUERY_VARIABLES}
    for variable in variables.values():
        assert not (dv.referenced(json.dumps(variable)) - set(variables) - BUILTIN - {"DS_PROMETHEUS"}), variable


def test_the_pools_dashboard_filters_on_pool_and_model():
    variables = _variables(BOARDS["moe-serve-pools.json"])
    for known in dv.QUERY_VARIABLES:
        variable = variables[known.name]
        assert variable["query"] == f"label_values({known.values_of}, {known.label_name})"
        assert variable["includeAll"] and variable["multi"] and variable["allValue"] == ".*"
        assert variable["current"]["value"] == ["$__all"]
    assert {"pool", "model"} <= {name for board in BOARDS.values() for name in _variables(board)}


def test_variable_values_come_from_series_that_carry_the_label():
    assert dv.POOL.label_name in CATALOGUE_LABELS[dv.POOL.values_of]
    # vLLM's Ray stat logger labels every metric with model_name (its served model name); the
    # series is one the panels query, so the integration test proves it is scraped with that label.
    assert any(f"{dv.MODEL.values_of}{{{dv.MODEL.label_name}=~" in dv.filtered(q.expr) for q in queries.ALL)


def _selectors(expr: str) -> list[tuple[str, str]]:
    return re.findall(r"(ray_[A-Za-z0-9_:]+)(\{[^}]*\})?", expr)


@pytest.mark.parametrize("name", NAMES)
def test_filters_name_only_labels_their_series_carry(name):
    for expr in _exprs(BOARDS[name]):
        for series, selector in _selectors(expr):
            filtered_labels = set(re.findall(r'(\w+)=~"\$\w+"', selector))
            if series in CATALOGUE_LABELS:
                assert filtered_labels <= set(CATALOGUE_LABELS[series]), (series, filtered_labels)
                if "pool" in CATALOGUE_LABELS[series]:  # every series that can follow `pool` does
                    assert "pool" in filtered_labels, (series, expr)
            elif series.startswith("ray_serve_deployment_"):
                assert filtered_labels == {"deployment"}, expr
            elif series.startswith("ray_vllm_"):
                assert filtered_labels == {"model_name"}, expr
            else:
                assert not filtered_labels, expr


def test_filtered_adds_matchers_once_and_keeps_the_query_otherwise_unchanged():
    expr = queries.KV_FAILURES.expr
    once = dv.filtered(expr)
    assert dv.filtered(once) == once
    assert once.count('pool=~"$pool"') == expr.count("ray_moe_serve_kv_pulls_total") == 3
    assert 'ray_moe_serve_kv_pulls_total{pool=~"$pool",outcome="failed"}' in once
    assert dv.substitute(once, {"pool": ".*"}).replace('pool=~".*",', "") == expr
    assert dv.filtered(queries.REQUEST_RATE.expr) == queries.REQUEST_RATE.expr  # route-level: no pool label
    # A selector that already names the label keeps its own matcher.
    assert dv.filtered('sum(ray_moe_serve_engine_requests_in_flight{pool="prefill"})') == \
        'sum(ray_moe_serve_engine_requests_in_flight{pool="prefill"})'
    assert dv.filtered("max by (ReplicaId) (ray_vllm_kv_cache_usage_perc)") == \
        'max by (ReplicaId) (ray_vllm_kv_cache_usage_perc{model_name=~"$model"})'


def test_referenced_and_substitute_know_every_grafana_variable_syntax():
    text = 'a{x=~"$pool"} ${model} ${pool:regex} [[datasource]] {{legend}}'
    assert dv.referenced(text) == {"pool", "model", "datasource"}
    assert dv.substitute(text, {"pool": "p", "model": "m", "datasource": "d"}) == 'a{x=~"p"} m p d {{legend}}'
    with pytest.raises(KeyError):
        dv.substitute("$unknown", {})


def test_provisioned_copies_differ_only_in_the_datasource_default():
    for name, board in BOARDS.items():
        copy = dashboards.provisioned(board)
        assert set(board) - set(copy) == {"__inputs", "__requires"}
        assert _variables(copy)["datasource"]["current"] == dashboards.PROVISIONED_DATASOURCE
        assert {k: v for k, v in copy.items() if k != "templating"} == \
            {k: v for k, v in board.items() if k not in ("templating", "__inputs", "__requires")}
        assert BOARDS[name]["__inputs"]  # the shared copy is left as it was
