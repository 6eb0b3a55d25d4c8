"""The dashboards' template variables and the label filters they add to the panel queries.

Pure text over PromQL (no Grafana SDK): the dashboard generator, its unit tests and the
integration test that evaluates the panels all use it.

- `datasource` (type datasource, query `prometheus`): every panel, target and query variable
  reads `${datasource}`, so a dashboard names no datasource of ours and imports into any Grafana.
- `pool` and `model` (label_values of series we scrape) narrow the panels. Which label a
  variable filters is decided per series, from the labels it is exported with, so a filter never
  drops a series for lacking its label:
  - our catalogue metrics (monitoring/metrics.py) that carry `pool`: `pool=~"$pool"`;
  - Ray Serve's `ray_serve_deployment_*` (labels deployment, application, ...):
    `deployment=~"$pool"`, because each pool is the Serve deployment of the same name
    (deployments/builder.py);
  - vLLM's `ray_vllm_*` (labels model_name, engine, ReplicaId; vLLM's Ray stat logger):
    `model_name=~"$model"`, the manifest's model name (vLLM's served_model_name).
  Request-level series (requests, latencies, phases, tokens, SLO) carry neither: the ingress
  serves every pool and model, so those panels stay whole-service.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from monitoring import metrics as m
from monitoring.queries import RAY_PREFIX, series

# What Grafana substitutes for "All": every value, and series without the label too.
ALL_VALUE = ".*"


@dataclass(frozen=True)
class QueryVariable:
    name: str  # referenced as $name in the panel queries
    label: str  # shown in Grafana's variable bar
    label_name: str  # the label whose values it offers
    values_of: str  # the series those values are read from (Grafana's label_values)

    @property
    def query(self) -> str:
        return f"label_values({self.values_of}, {self.label_name})"


DATASOURCE = "datasource"
# Every engine replica exports its in-flight gauge from the start, under its pool's name.
POOL = QueryVariable("pool", "Pool", "pool", series(m.ENGINE_IN_FLIGHT))
MODEL = QueryVariable("model", "Model", "model_name", "ray_vllm_num_requests_running")
QUERY_VARIABLES: tuple[QueryVariable, ...] = (POOL, MODEL)

_CATALOGUE_LABELS: dict[str, tuple[str, ...]] = {
    f"{RAY_PREFIX}{name}": metric.labels for metric in m.CATALOGUE for name in m.exposed_names(metric)}


def series_filters(name: str) -> dict[str, str]:
    """label -> variable that filters it, for one scraped series name (empty: not filtered)."""
    labels = _CATALOGUE_LABELS.get(name)
    if labels is not None:
        return {"pool": POOL.name} if "pool" in labels else {}
    if name.startswith("ray_serve_deployment_"):
        return {"deployment": POOL.name}
    if name.startswith("ray_vllm_"):
        return {MODEL.label_name: MODEL.name}
    return {}


# A series name and its selector, if any (`name{a="b"}`); names only, never inside a label value.
_SERIES = re.compile(r'(?<![\w"])(ray_[A-Za-z0-9_:]+)(\{[^}]*\})?')
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")


def filtered(expr: str) -> str:
    """`expr` with each series narrowed by the variables that apply to it (labels it already
    matches on are left alone)."""

    def narrow(match: re.Match) -> str:
        name, selector = match.group(1), match.group(2) or "{}"
        present = set(_MATCHER_LABEL.findall(selector))
        added = [f'{label}=~"${variable}"' for label, variable in series_filters(name).items() if label not in present]
        if not added:
            return match.group(0)
        inner = selector[1:-1].strip()
        return name + "{" + ",".join(added + ([inner] if inner else [])) + "}"

    return _SERIES.sub(narrow, expr)


# $name, ${name}, ${name:format} and the deprecated [[name]].
_REFERENCE = re.compile(r"\$(\w+)|\$\{(\w+)(?::\w+)?\}|\[\[(\w+)(?::\w+)?\]\]")


def referenced(text: str) -> set[str]:
    """Names of the template variables `text` refers to."""
    return {next(group for group in match.groups() if group) for match in _REFERENCE.finditer(text)}


def substitute(text: str, values: dict[str, str]) -> str:
    """`text` with each variable replaced by its value, as Grafana does before querying (an
    unknown variable is a KeyError)."""
    return _REFERENCE.sub(lambda match: values[next(group for group in match.groups() if group)], text)
