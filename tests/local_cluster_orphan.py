"""Run by tests/integration/test_local_cluster_shutdown.py in a process of its own (a driver
can join one Ray cluster; the test session's is taken): start a one-node LocalCluster, have a
detached actor (as Serve's replicas are) start a child that left the actor's process group and
ignores SIGTERM, stop the cluster, and print the child's pid as JSON for the test to check. Also prints where a
Serve mode variable of the cluster's environment is seen: by the node's processes, not by this
driver afterwards.

Ray's own cleanup ends a worker's children by process group (measured: a plain child of such an
actor is gone after a graceful stop and after its node is killed); a child in a session of its
own is beyond it, and is what cluster/process_tree.py is there for.

With `--leave-listener PORT` it plays a `moe-serve up` whose terminal crashed: the actor's child
listens on PORT (as Serve's HAProxy listens on the HTTP port, from a session of its own), the
script prints the child's pid and the actor's process title as JSON and waits, without stopping
anything, for the test to SIGKILL its process group. The child then outlives it, as the
issue's HAProxy did, carrying the owner marker it inherited through the Ray node
(cluster/leftovers.py)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from cluster.local_cluster import ClusterPorts, LocalCluster
from cluster.manifest import LocalClusterSpec, LocalNodeSpec
from deployments.ports import reserve_port

MODE = "RAY_SERVE_THROUGHPUT_OPTIMIZED"
CHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"


LISTENER = """
import signal, socket, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
server = socket.socket()
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen()
print("listening", flush=True)
time.sleep(600)
"""


def leave_listener(port: int) -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    ports = ClusterPorts(gcs=reserve_port(), dashboard=reserve_port(), metrics_export_base=reserve_port())
    cluster = LocalCluster(LocalClusterSpec(nodes=[LocalNodeSpec(name="only", num_cpus=1)]), ports)
    cluster.start(progress=lambda line: print(line, file=sys.stderr))
    import ray

    ray.init(address=cluster.address, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Spawner:
        def start_listener(self, port: int) -> tuple[int, str]:
            import subprocess

            child = subprocess.Popen([sys.executable, "-c", LISTENER, str(port)], start_new_session=True,
                                     stdout=subprocess.PIPE, text=True)
            child.stdout.readline()  # listening
            title = open("/proc/self/cmdline", "rb").read().split(b"\0")[0].decode()
            return child.pid, title

    spawner = Spawner.options(name="spawner", lifetime="detached").remote()
    child_pid, title = ray.get(spawner.start_listener.remote(port), timeout=120)
    print(json.dumps({"child_pid": child_pid, "actor_title": title, "owner_pid": os.getpid()}), flush=True)
    time.sleep(600)  # until SIGKILLed with the process group


def main() -> None:
    if sys.argv[1:2] == ["--leave-listener"]:
        leave_listener(int(sys.argv[2]))
        return
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
