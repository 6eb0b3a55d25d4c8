"""The adapter to a running Ray cluster and Serve: connect, deploy, report, remove."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from cluster.checkpoints import resolve_model_path
from cluster.errors import ClusterError
from cluster.local_cluster import LOOPBACK, apply_ray_environment
from cluster.app_registry import forget_app, record_app, recorded_apps
from cluster.manifest import Manifest


def connect(address: str | None = None) -> None:
    """Join a running cluster as a driver ("auto": RAY_ADDRESS or the latest local cluster)."""
    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    if address == "auto" or address.split(":")[0] in {LOOPBACK, "localhost"}:
        apply_ray_environment(override=False)
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address=address, log_to_driver=False, logging_level="WARNING")
    except ConnectionError as exc:
        raise ClusterError(f"no Ray cluster at {address!r}: {exc}. Start one with `moe-serve up` "
                           "or pass --address HOST:PORT") from None


@dataclass(frozen=True)
class DeployResult:
    app_name: str
    url: str
    model: str
    seconds: float


# Engines load weights before they report ready: seconds for the tiny CPU checkpoints, many
# minutes for DeepSeek-V3 on a GPU node. Past this, a deploy that is still waiting is almost
# always waiting for resources no node has, and says so instead of hanging.
DEFAULT_DEPLOY_TIMEOUT_S = 1800.0
_POLL_S = 2.0


def deploy(manifest: Manifest, progress=print, timeout_s: float = DEFAULT_DEPLOY_TIMEOUT_S) -> DeployResult:
    """Deploy (or update) the manifest's application on the connected cluster; waits until it
    is RUNNING, reporting replica states as they change. Raises ClusterError when Serve marks
    the application failed or it is not running within `timeout_s` (the message carries every
    deployment's state and Serve's own explanation, e.g. the resources a replica waits for).
    The application is left in place for inspection; `moe-serve down --app NAME` removes it."""
    from ray import serve

    from deployments.builder import build_app

    started = time.monotonic()
    model_path = str(resolve_model_path(manifest.model.path))
    progress(f"checkpoint {model_path}")
    serve.start(http_options={"host": manifest.http.host, "port": manifest.http.port},
                proxy_location=manifest.http.proxy_location)
    pool_address = start_kv_pool(manifest, progress) if manifest.kv_pool.enabled else None
    record_app(manifest.name)  # before Serve has it: an interrupted deploy is still ours to remove
    progress(f"deploying application '{manifest.name}': "
             + ", ".join(f"{p.name} x{p.replicas} ({p.role.value}{_bounds(p)})" for p in manifest.pools)
             + " (vLLM engines take ~30-60 s to start on CPU)")
    serve.run_many([serve.RunTarget(build_app(manifest, model_path, pool_address), name=manifest.name,
                                    route_prefix=manifest.http.route_prefix)],
                   wait_for_applications_running=False)
    wait_until_running(manifest.name, timeout_s, progress)
    url = f"http://{manifest.http.host}:{manifest.http.port}{manifest.http.route_prefix.rstrip('/')}"
    return DeployResult(manifest.name, url, manifest.model.name, time.monotonic() - started)


def wait_until_running(app_name: str, timeout_s: float, progress=print) -> None:
    from ray import serve

    started = time.monotonic()
    last_report = None
    while True:
        app = serve.status().applications.get(app_name)
        state = _name(app.status) if app else "MISSING"
        if state == "RUNNING":
            return
        elapsed = time.monotonic() - started
        if state in ("DEPLOY_FAILED", "UNHEALTHY") or elapsed > timeout_s:
            why = f"did not become RUNNING within {timeout_s:.0f}s" if state not in ("DEPLOY_FAILED", "UNHEALTHY") \
                else f"is {state}"
            raise ClusterError(f"application '{app_name}' {why}:\n{status_text()}\n"
                               f"fix the cause above, then redeploy; `moe-serve down --app {app_name}` removes it")
        report = _replica_summary(app) if app else state
        if report != last_report:
            progress(f"waiting for '{app_name}' ({elapsed:.0f}s): {report}")
            last_report = report
        time.sleep(_POLL_S)


def _replica_summary(app) -> str:
    parts = []
    for name, dep in app.deployments.items():
        states = ", ".join(f"{_name(s).lower()} {n}" for s, n in dep.replica_states.items() if n)
        parts.append(f"{name} [{states or 'no replicas yet'}]")
    return "; ".join(parts)


def start_kv_pool(manifest: Manifest, progress=print) -> dict:
    """The application's KV pool master, on the head node; kept across redeploys."""
    from cluster.kv_pool_service import ensure_pool

    spec = manifest.kv_pool
    node_id, host = head_node()
    progress(f"starting the KV pool (Mooncake Store master) for '{manifest.name}' on the head node")
    address = ensure_pool(manifest.name, host=host, rpc_port=spec.master_rpc_port,
                          http_port=spec.master_http_port, node_id=node_id, offload=spec.disk is not None,
                          keep_pinned=spec.sessions is not None)
    if spec.disk is not None and not address.get("offload"):
        # Mooncake clients with a disk tier refuse a master without offload (setup fails).
        raise ClusterError(f"the KV pool master of '{manifest.name}' was started without a disk tier and is "
                           "kept across redeploys; run `moe-serve down` for this application, then deploy again "
                           "to start it with kv_pool.disk")
    if spec.sessions is not None and not address.get("keep_pinned"):
        # Its eviction would take pinned objects like any other: sessions would not be kept.
        raise ClusterError(f"the KV pool master of '{manifest.name}' was started without kv_pool.sessions and is "
                           "kept across redeploys; run `moe-serve down` for this application, then deploy again "
                           "to start it keeping sessions' pinned objects")
    progress(f"KV pool master at {address['master_address']} (metadata {address['metadata_url']}); "
             f"each engine contributes {spec.segment_mib} MiB"
             + (f" (prefill engines {spec.prefill_segment_mib} MiB)" if spec.prefill_segment_mib is not None else ""))
    return address


def head_node() -> tuple[str, str]:
    """(node id, IP) of the cluster's head node: where the pool master lives whichever process
    deploys (a driver on the head, a `ray job` anywhere, Serve's config build task)."""
    import ray

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeID"], node["NodeManagerAddress"]
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def _bounds(pool) -> str:
    return f", autoscaled {pool.autoscaling.min_replicas}..{pool.autoscaling.max_replicas}" if pool.autoscaling else ""


def status_text() -> str:
    import ray
    from ray import serve

    from cluster.status_report import AppView, DeploymentView, NodeView, degraded_lines

    raw_nodes = ray.nodes()
    nodes = [NodeView(node["NodeID"], node["NodeManagerAddress"], bool(node.get("Alive")),
                      {k: v for k, v in node.get("Labels", {}).items() if not k.startswith("ray.io/")})
             for node in raw_nodes]
    resources = {node["NodeID"]: node.get("Resources", {}) for node in raw_nodes}
    lines = ["nodes:"]
    for node in nodes:
        if node.alive:
            cpus = resources[node.node_id].get("CPU", 0)
            lines.append(f"  {node.address:<16} {node.node_id[:12]}  cpus={cpus:g}  labels={dict(node.labels)}")
    status = serve.status()
    if not status.applications:
        lines.append("no Serve applications")
    apps = []
    for name, app in status.applications.items():
        lines.append(f"application {name}: {_name(app.status)}")
        views = []
        for dep_name, dep in app.deployments.items():
            states = {_name(state): count for state, count in dep.replica_states.items()}
            views.append(DeploymentView(dep_name, _name(dep.status), states, dep.message or ""))
            replicas = ", ".join(f"{state}={count}" for state, count in states.items())
            lines.append(f"  {dep_name:<20} {_name(dep.status):<10} replicas: {replicas or '-'}")
            if dep.message:
                lines.append(f"    {dep.message[:300]}")
        apps.append(AppView(name, _name(app.status), views))
    problems = degraded_lines(apps, nodes)
    lines.append("degraded:" if problems else "degraded: nothing (every node up, every deployment serving)")
    lines.extend(f"  {problem}" for problem in problems)
    return "\n".join(lines)


def _name(value: object) -> str:
    """Serve reports statuses as enums or plain strings depending on the field."""
    return str(getattr(value, "value", value))


def remove(app_name: str | None) -> str:
    """Delete `app_name`, or every application moe-serve deployed on this cluster (by either
    path), with their KV pools. Serve applications someone else deployed are left running."""
    from ray import serve

    from cluster.kv_pool_service import stop_pool

    running = set(serve.status().applications)
    if app_name:
        if app_name not in running:
            raise ClusterError(f"no Serve application named {app_name!r} (running: {', '.join(sorted(running)) or 'none'})")
        names = [app_name]
    else:
        names = sorted(recorded_apps() & running)
        for stale in recorded_apps() - running:
            forget_app(stale)
    lines = []
    for name in names:
        serve.delete(name)
        forget_app(name)
        lines.append(f"deleted application {name}" + (" and its KV pool" if stop_pool(name) else ""))
    others = sorted(running - set(names))
    if not names:
        lines.append("no application deployed by moe-serve is running")
    if others and not app_name:
        lines.append(f"left running (not deployed by moe-serve): {', '.join(others)}")
    return "\n".join(lines)
