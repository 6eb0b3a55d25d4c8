"""What moe-serve exports, and the dashboards, alerts and reports built on it.

Definitions (pure data):
- `metrics`: every metric we export (name, kind, help, labels, buckets), the `CATALOGUE`.
- `queries`: the PromQL that dashboards, alert rules, `moe-serve report` and the autoscaler share.
- `phases`: a request's end-to-end latency split into phases (timestamps in, durations out).

Recording (adapters to Ray's metrics pipeline):
- `exporter`: the one adapter to `ray.util.metrics`.
- `request_metrics`: what the ingress records per request; `engine_metrics`: what an engine
  server (or one rank of an expert-parallel group) exports, its KV connector's counters included.

Reading and showing:
- `prometheus_api`: the one adapter to Prometheus's HTTP API; `prometheus_config` and
  `local_prometheus`: a Prometheus that discovers Ray's metrics endpoints, next to a local cluster.
- `dashboards` (with `dashboard_variables`): Grafana dashboards generated from `queries`;
  `alerts`: Prometheus alert rules from `queries` and a manifest's SLO; `report`: the key panels
  as PNG. `extras` holds what needs a pyproject extra (the dashboard generator, plotting).
- `grafana/`, `prometheus/`: the generated dashboards and rules, as files.
"""
