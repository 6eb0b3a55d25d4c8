"""Run by tests/integration/test_local_cluster_shutdown.py in a process of its own (a driver
can join one Ray cluster; the test session's is taken): start a one-node LocalCluster, have a
detached actor (as Serve's replicas are) start a child that left the actor's process group and
ignores SIGTERM, stop the cluster, and print the child's pid as JSON for the test to check. Also prints where a
Serve mode variable of the cluster's environment is seen: by the node's processes, not by this
driver afterwards.

Ray's own cleanup ends a worker's children by process group (measured: a plain child of such an
actor is gone after a graceful stop and after its node is killed); a child in a session of its
own is beyond it, and is what cluster/process_tree.py is there for."""

from __future__ import annotations

import json
import logging
import os
import sys

from cluster.local_cluster import ClusterPorts, LocalCluster
from cluster.manifest import LocalClusterSpec, LocalNodeSpec
from deployments.ports import reserve_port

MODE = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
CHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    ports = ClusterPorts(gcs=reserve_port(), dashboard=reserve_port(), metrics_export_base=reserve_port())
    cluster = LocalCluster(LocalClusterSpec(nodes=[LocalNodeSpec(name="only", num_cpus=1)]), ports,
                           environment={MODE: "1"})
    cluster.start(progress=lambda line: print(line, file=sys.stderr))
    try:
        import ray

        ray.init(address=cluster.address, log_to_driver=False)

        @ray.remote(num_cpus=0)
        class Spawner:
            def start_child(self) -> tuple[int, str | None]:
                import os
                import subprocess

                return subprocess.Popen([sys.executable, "-c", CHILD], start_new_session=True).pid, os.environ.get(MODE)

        spawner = Spawner.options(name="spawner", lifetime="detached").remote()
        child_pid, node_mode = ray.get(spawner.start_child.remote(), timeout=120)
        ray.shutdown()
    finally:
        cluster.shutdown()
    print(json.dumps({"child_pid": child_pid, "node_mode": node_mode, "driver_mode": os.environ.get(MODE)}))


if __name__ == "__main__":
    main()
