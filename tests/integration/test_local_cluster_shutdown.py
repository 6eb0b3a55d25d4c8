"""A stopped local cluster leaves no process behind (cluster/process_tree.py): an actor's child
that left the actor's process group (beyond Ray's own cleanup) and ignores SIGTERM is ended
when the cluster is shut down. Real Ray: its own one-node cluster, in a process of its own.

And what a killed `moe-serve up` leaves (cluster/leftovers.py): a cluster whose owner is
SIGKILLed with its process group leaves a listener in a session of its own (Serve's HAProxy
on the HTTP port in issue 27); the pre-start check ends it and frees the port. A listener
moe-serve did not start is refused, by the check and by `moe-serve up` itself, with one line
naming the port, the process and the command that frees it, and is left running."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from cluster.errors import ClusterError
from cluster.leftover_processes import clear_leftovers, read_snapshot
from cluster.leftovers import OWNER_VARIABLE, PortNeed
from deployments.ports import reserve_port
from tests.integration.conftest import REPO

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _keep_the_sessions_ray_address():
    """Each cluster these tests start in a process of their own writes its address to Ray's
    /tmp/ray/ray_current_cluster; one killed outright never takes it back. Later tests asking
    Ray's state API without an address (list_actors) would then wait on that dead cluster's GCS
    and time out (seen in CI): the session's address is put back after each test."""
    current = Path("/tmp/ray/ray_current_cluster")
    before = current.read_text() if current.exists() else None
    yield
    if before is None:
        current.unlink(missing_ok=True)
    else:
        current.write_text(before)


def test_stopping_the_cluster_ends_a_child_that_left_its_workers_process_group():
    result = subprocess.run([sys.executable, str(REPO / "tests" / "local_cluster_orphan.py")], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    child_pid = seen["child_pid"]
    # The cluster's Serve mode reached the node's processes, and this driver did not keep it (in
    # throughput mode a synchronous handle call from a driver fails: no event loop).
    assert seen["node_mode"] == "1" and seen["driver_mode"] is None, seen
    assert "ended 1 process(es) left running" in result.stderr, result.stderr[-3000:]
    try:
        alive = psutil.Process(child_pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        alive = False
    assert not alive, f"pid {child_pid} outlived the cluster"


LISTENER = """
import socket, sys, time
server = socket.socket()
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen()
print("listening", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _http_need(port: int) -> PortNeed:
    return PortNeed(port, "127.0.0.1", "the HTTP endpoint, http.port", "set http.port in the manifest to a free port")


def _marked_by(owner_pid: int) -> list[str]:
    """The running processes whose marker names `owner_pid`."""
    return [f"{facts.name} (pid {facts.pid})" for facts in read_snapshot().processes
            if facts.owner is not None and facts.owner.pid == owner_pid]


def _last_json_line(process: subprocess.Popen, timeout_s: float) -> dict:
    """The first JSON line `process` prints, or a failure with what it wrote to stderr."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    deadline_s = time.monotonic() + timeout_s
    while time.monotonic() < deadline_s:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert process.poll() is None, f"exited {process.returncode}"
            continue
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON line within {timeout_s:.0f}s")


def test_up_ends_the_listener_a_killed_cluster_left_on_its_port():
    port = reserve_port()
    # A session of its own, as a terminal runs `moe-serve up`; the crash is SIGKILL to the group.
    owner = subprocess.Popen([sys.executable, str(REPO / "tests" / "local_cluster_orphan.py"), "--leave-listener",
                              str(port)], cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
    child_pid = None
    try:
        seen = _last_json_line(owner, timeout_s=300)
        child_pid = seen["child_pid"]
        # The marker is set in the owner, and titles still show (the environment is kept apart).
        assert seen["owner_pid"] == owner.pid and seen["actor_title"].startswith("ray::Spawner"), seen
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(30)
        time.sleep(1)
        # Issue 27: the listener outlives its killed cluster and holds the port.
        assert _alive(child_pid) and not _free(port)
        assert psutil.Process(child_pid).environ().get(OWNER_VARIABLE, "").startswith(f"{owner.pid}:")

        said: list[str] = []
        started_s = time.monotonic()
        ended = clear_leftovers([_http_need(port)], progress=said.append)
        took_s = time.monotonic() - started_s
        print(f"clear_leftovers took {took_s:.1f}s: {said}")
        assert child_pid in {left.process.pid for left in ended}
        assert not _alive(child_pid) and _free(port)
        assert any(f"(pid {child_pid}, :{port})" in line and f"(pid {owner.pid})" in line for line in said), said
        # Whatever else the crash left of this cluster (Ray's processes outside the group) went too.
        assert _marked_by(owner.pid) == []
    finally:
        if owner.poll() is None:
            os.killpg(owner.pid, signal.SIGKILL)
        if child_pid is not None and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


@pytest.fixture
def foreign_listener():
    """A process that moe-serve did not start, listening on a port (no owner marker)."""
    port = reserve_port()
    env = {key: value for key, value in os.environ.items() if key != OWNER_VARIABLE}
    process = subprocess.Popen([sys.executable, "-c", LISTENER, str(port)], stdout=subprocess.PIPE, text=True,
                               env=env, start_new_session=True)
    try:
        assert process.stdout.readline().strip() == "listening"
        yield process, port
    finally:
        process.kill()
        process.wait(10)


def test_a_foreign_listener_is_refused_with_the_port_its_pid_and_the_command_that_frees_it(foreign_listener):
    process, port = foreign_listener
    with pytest.raises(ClusterError) as refused:
        clear_leftovers([_http_need(port)], progress=lambda line: None)
    message = str(refused.value)
    assert message.startswith(f"port {port} (the HTTP endpoint, http.port) is in use by pid {process.pid} (`")
    assert f"`kill {process.pid}`" in message and message.endswith("set http.port in the manifest to a free port")
    assert process.poll() is None


def test_moe_serve_up_refuses_a_foreign_listener_at_once_without_a_traceback(foreign_listener, tmp_path):
    import yaml

    process, port = foreign_listener
    data = yaml.safe_load((REPO / "manifests" / "local.yaml").read_text())
    data["http"]["port"] = port
    manifest = tmp_path / "held.yaml"
    manifest.write_text(yaml.safe_dump(data))
    started_s = time.monotonic()
    result = subprocess.run([str(Path(sys.executable).parent / "moe-serve"), "up", str(manifest), "--no-prometheus",
                             "--gcs-port", str(reserve_port()), "--dashboard-port", str(reserve_port())],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    took_s = time.monotonic() - started_s
    print(f"moe-serve up refused in {took_s:.1f}s")
    assert result.returncode == 3, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert f"port {port} (the HTTP endpoint, http.port) is in use by pid {process.pid}" in errors[0]
    assert f"`kill {process.pid}`" in errors[0]
    assert "starting Ray" not in result.stderr  # refused before anything started
    assert process.poll() is None
