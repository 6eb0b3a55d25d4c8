"""A multi-node Ray cluster on this machine: one real raylet per manifest node, with labels.

Owned by the process that starts it (`moe-serve up`, or the test session) and stopped with
it, so it never touches other Ray clusters on the machine. All traffic stays on loopback.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from cluster.errors import ClusterError
from cluster.leftover_processes import mark_owner
from cluster.manifest import LocalClusterSpec
from cluster.process_tree import end_survivors, process_tree
from cluster.ray_node_env import NODE_ENVIRONMENT

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ClusterPorts:
    gcs: int = 6379
    dashboard: int = 8265
    metrics_export_base: int = 8090  # node i exports Ray (and engine) metrics on base + i


def ray_environment() -> dict[str, str]:
    """Environment every Ray process of ours needs (set before Ray starts in this process)."""
    venv_bin = str(Path(sys.executable).parent)
    path = os.environ.get("PATH", "")
    return {
        # Ray 2.60 enables token auth for new clusters; every client must then say so explicitly.
        "RAY_AUTH_MODE": "token",
        # Ray rewrites "127.0.0.1" in addresses to the machine's interface IP when clusters are
        # enabled; our raylets listen on loopback only. This flag (named for Windows/OSX) makes
        # Ray resolve localhost to 127.0.0.1, keeping every driver and job on loopback.
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        # `ray job submit -- moe-serve ...` runs on the head with this PATH: make our CLI findable.
        "PATH": path if path.startswith(venv_bin) else f"{venv_bin}:{path}",
        # vLLM picks the machine's interface for its engine sockets; keep them on loopback too.
        "VLLM_HOST_IP": os.environ.get("VLLM_HOST_IP", LOOPBACK),
        # The engine's worker processes are spawned; keep CPU engines from pinning cores.
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        # Engine processes die with the replica that started them (cluster/ray_node_env.py).
        **NODE_ENVIRONMENT,
    }


def apply_ray_environment(override: bool = True) -> None:
    """Put `ray_environment()` into this process, also when Ray was imported before.

    Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when `ray` is first imported; a process
    that imported Ray earlier (a test session, a library caller) would otherwise still rewrite
    127.0.0.1 to the machine's interface IP and fail to reach our loopback-only GCS.
    """
    for key, value in ray_environment().items():
        if override:
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        constants.ENABLE_RAY_CLUSTER = False


def ensure_auth_token() -> None:
    """Create Ray's cluster token (~/.ray/auth_token) if missing; raylets refuse to start without."""
    import subprocess

    ray_cli = Path(sys.executable).parent / "ray"
    result = subprocess.run([str(ray_cli), "get-auth-token", "--generate"], capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterError(f"could not create a Ray auth token: {result.stderr.strip()[-500:]}")


def haproxy_isolation(environment: dict[str, str], ports: ClusterPorts) -> dict[str, str]:
    """With Serve's HAProxy front: this cluster's own HAProxy files and side ports.

    Serve's defaults put every HAProxy's config, admin socket and server state under
    /tmp/haproxy-serve and its stats and metrics listeners on ports 8404 and 9101: a second
    cluster on the machine (a test session beside `moe-serve up`, a benchmark's) would take over
    the first one's socket or fail to bind. Keyed by the GCS port, which is unique per machine."""
    if environment.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return {}
    from deployments.ports import reserve_port

    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"moe-serve-haproxy-{ports.gcs}"
    return {
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(base / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(base / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(base),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(base / "server-state"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(reserve_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(reserve_port()),
    }


class LocalCluster:
    def __init__(self, spec: LocalClusterSpec, ports: ClusterPorts = ClusterPorts(),
                 object_store_bytes: int = 256 << 20, environment: dict[str, str] | None = None):
        """`environment`: variables every Ray process of the nodes must see from its start (set
        in this process while the nodes start, which inherit it, then taken back)."""
        self.spec = spec
        self.environment = dict(environment or {})
        self.ports = ports
        self._object_store_bytes = object_store_bytes
        self._cluster = None
        self._nodes: dict[str, object] = {}  # node name -> ray.cluster_utils node handle

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.ports.gcs}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports.dashboard}"

    @classmethod
    def for_manifest(cls, manifest, ports: ClusterPorts = ClusterPorts(), **kwargs) -> "LocalCluster":
        """The manifest's local cluster, with the Serve variables its http section needs."""
        from cluster.manifest_http import serve_environment

        return cls(manifest.local_cluster, ports, environment=serve_environment(manifest.http), **kwargs)

    def start(self, progress=print) -> "LocalCluster":
        # Every process of the cluster inherits this process's owner marker, so that a later
        # `moe-serve up` can tell what this one left running if it is killed without its
        # `finally` (cluster/leftovers.py). Set for good: Prometheus and anything else the owner
        # starts beside the cluster carry it too.
        mark_owner()
        # Before Ray is imported: Ray reads its auth mode once, at import.
        apply_ray_environment()
        node_only = {**self.environment, **haproxy_isolation(self.environment, self.ports)}
        driver_values = {key: os.environ.get(key) for key in node_only}
        os.environ.update(node_only)
        ensure_auth_token()
        from ray.cluster_utils import Cluster

        head, *workers = self.spec.nodes
        started = time.monotonic()
        try:
            progress(f"starting Ray head node '{head.name}' ({head.num_cpus} CPUs, labels {head.labels}) "
                     f"on {self.address}")
            self._cluster = Cluster(initialize_head=True, head_node_args=dict(
                self._node_args(head, 0), gcs_server_port=self.ports.gcs, include_dashboard=True,
                dashboard_host=LOOPBACK, dashboard_port=self.ports.dashboard))
            self._nodes[head.name] = self._cluster.head_node
            for index, node in enumerate(workers, start=1):
                progress(f"starting Ray node '{node.name}' ({node.num_cpus} CPUs, labels {node.labels})")
                self._nodes[node.name] = self._cluster.add_node(**self._node_args(node, index))
            self._cluster.wait_for_nodes()
        except Exception as exc:
            self.shutdown()
            raise ClusterError(f"could not start the local Ray cluster: {exc}. Is another cluster using port "
                               f"{self.ports.gcs} or {self.ports.dashboard}? Stop it (`ray stop`) or change ports.") from exc
        finally:
            # The nodes have the Serve mode now; this process is a driver and stays a plain
            # client. Serve's throughput-optimized mode runs a handle's router on the caller's
            # event loop, so a synchronous `handle.method.remote().result()` here would fail
            # with "No event loop running" if Serve were imported after this point.
            _restore(driver_values)
        progress(f"{len(self.spec.nodes)} Ray nodes up in {time.monotonic() - started:.1f}s; "
                 f"dashboard {self.dashboard_url}")
        return self

    def _node_args(self, node, index: int) -> dict:
        return dict(num_cpus=node.num_cpus, num_gpus=0, labels=dict(node.labels), node_ip_address=LOOPBACK,
                    object_store_memory=self._object_store_bytes,
                    metrics_export_port=self.ports.metrics_export_base + index)

    def remove_node(self, name: str) -> None:
        """Take the worker node `name` out of the cluster, as a machine failure would (its raylet
        and every process on it are killed)."""
        node = self._nodes.pop(name)
        started = process_tree(_node_pids(node))
        self._cluster.remove_node(node, allow_graceful=False)
        end_survivors(started)  # on a real machine failure they would be gone too

    def shutdown(self) -> None:
        self._nodes.clear()
        if self._cluster is not None:
            nodes = [self._cluster.head_node, *self._cluster.worker_nodes]
            started = process_tree(pid for node in nodes if node is not None for pid in _node_pids(node))
            self._cluster.shutdown()
            self._cluster = None
            end_survivors(started)


def _restore(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _node_pids(node) -> list[int]:
    """The pids of the processes a ray.cluster_utils node started (raylet, GCS, dashboard, ...);
    their descendants are the node's workers and everything those started."""
    return [info.process.pid for infos in node.all_processes.values() for info in infos
            if info.process is not None]
