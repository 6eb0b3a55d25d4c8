"""The documents that go beside a RayService: a Prometheus Operator PodMonitor for Ray's metrics
endpoints, a PrometheusRule with moe-serve's alerts and a NetworkPolicy for the application's
pods. Pure: a manifest in, dicts out.

Every Ray pod (head and workers) serves Ray's metrics, ours and vLLM's included, on its port
named `metrics` (8080). The PodMonitor scrapes that port on every pod of the application and
names the job `ray`, as the local Prometheus does, so that the dashboards and alert rules
(`up{job="ray"}`) read the same series on Kubernetes.

The NetworkPolicy follows README's "Securing a real cluster": the KV transfer ports serve raw
KV pages, and the engines pick them per start (any free port), as Ray picks its worker ports, so
every port of the pods is open only to the application's own pods; the OpenAI endpoint (the
manifest's http.port) is open to anyone; the KubeRay operator may reach the head's dashboard,
and Prometheus the metrics port.
"""

from __future__ import annotations

from cluster.manifest import Manifest

APP_LABEL = "moe-serve/app"  # on every pod of the application: the PodMonitor's and policy's selector
POOL_LABEL = "moe-serve/pool"  # the pool a worker pod serves ("head" on the head)
METRICS_PORT = 8080  # Ray's metrics export port on every node (KubeRay's default too)
DASHBOARD_PORT = 8265  # Ray dashboard on the head: KubeRay submits serveConfigV2 and polls status here
DASHBOARD_AGENT_PORT = 52365  # every node's dashboard agent: older operators read Serve status from it
GCS_PORT = 6379
CLIENT_PORT = 10001


def pod_monitor(manifest: Manifest) -> dict:
    k8s = manifest.kubernetes
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": f"{manifest.name}-ray-metrics", "namespace": k8s.namespace,
                     "labels": {APP_LABEL: manifest.name, **k8s.pod_monitor_labels}},
        "spec": {
            "selector": {"matchLabels": {APP_LABEL: manifest.name}},
            "namespaceSelector": {"matchNames": [k8s.namespace]},
            "podMetricsEndpoints": [{
                "port": "metrics",
                "path": "/metrics",
                "interval": f"{manifest.observability.scrape_interval_s:g}s",
                # The dashboards and alerts select job="ray" (monitoring/queries.py), the local
                # Prometheus's job name, rather than the operator's "<namespace>/<monitor>".
                "relabelings": [{"action": "replace", "targetLabel": "job", "replacement": "ray"}],
            }],
        },
    }


def prometheus_rule(manifest: Manifest) -> dict:
    """The alert rules of `python -m monitoring.alerts` for this manifest's SLO, as the Prometheus
    Operator takes them."""
    from monitoring.alerts import rules_document, rules_for_manifest

    k8s = manifest.kubernetes
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": f"{manifest.name}-alerts", "namespace": k8s.namespace,
                     "labels": {APP_LABEL: manifest.name, **k8s.pod_monitor_labels}},
        "spec": rules_document(rules_for_manifest(manifest)),
    }


def network_policy(manifest: Manifest) -> dict:
    k8s = manifest.kubernetes
    own_pods = {"podSelector": {"matchLabels": {APP_LABEL: manifest.name}}}

    def namespace(name: str) -> dict:
        return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}

    def tcp(*ports: int) -> list[dict]:
        return [{"protocol": "TCP", "port": port} for port in ports]

    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{manifest.name}-pods", "namespace": k8s.namespace,
                     "labels": {APP_LABEL: manifest.name}},
        "spec": {
            "podSelector": {"matchLabels": {APP_LABEL: manifest.name}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [own_pods]},  # Ray (GCS, object store, workers), KV transfer, NCCL: own pods only
                {"ports": tcp(manifest.http.port)},  # the OpenAI endpoint (API keys), from anywhere
                {"from": [namespace(k8s.operator_namespace)], "ports": tcp(DASHBOARD_PORT, DASHBOARD_AGENT_PORT)},
                {"from": [namespace(k8s.prometheus_namespace)], "ports": tcp(METRICS_PORT)},
            ],
        },
    }
