"""cluster/leftover_processes.py on real processes (no Ray): the owner marker reaches a child and
stays readable after the child retitles itself as vLLM's and Ray's processes do; a listener of a
dead owner is planned as a leftover and ended; a foreign listener is refused, never ended. The
full path through a real Ray cluster killed with its process group is in
tests/integration/test_local_cluster_shutdown.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest

from cluster.leftover_processes import KEEP_ENVIRON, mark_owner, port_holders, read_snapshot, start_ticks
from cluster.leftovers import OWNER_VARIABLE, Owner, PortNeed
from cluster.process_tree import end_processes
from deployments.ports import reserve_port

LISTENER = """
import signal, socket, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as stubborn as a process stuck in shutdown
server = socket.socket()
server.bind(("127.0.0.1", int(sys.argv[1])))
server.listen()
print("ready", flush=True)
time.sleep(600)
"""
RETITLED = """
import sys, time
{retitle}
print("ready", flush=True)
time.sleep(600)
"""
RETITLES = {
    "vllm": "import setproctitle; setproctitle.setproctitle('VLLM::DPCoordinator')",  # vLLM's set_process_title
    "ray": "import ray._raylet; ray._raylet.setproctitle('ray::ServeReplica:app:engine')",  # a Ray worker's title
}


@pytest.fixture
def owner_environment(monkeypatch):
    """mark_owner() on this process, undone after the test."""
    for key in (OWNER_VARIABLE, *KEEP_ENVIRON):
        monkeypatch.delenv(key, raising=False)
    yield


@pytest.fixture
def started():
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        process.kill()
        process.wait(10)


def _start(started, code: str, *args: str, env: dict | None = None) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True,
                               env=env, start_new_session=True)
    started.append(process)
    assert process.stdout.readline().strip() == "ready"
    return process


def _dead_owner() -> Owner:
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    owner = Owner(finished.pid, start_ticks(finished.pid))
    finished.wait()
    return owner


@pytest.mark.parametrize("retitle", sorted(RETITLES))
def test_the_marker_stays_readable_after_a_child_retitles_itself(owner_environment, started, retitle):
    owner = mark_owner()
    child = _start(started, RETITLED.format(retitle=RETITLES[retitle]))
    snapshot = read_snapshot()
    [facts] = [facts for facts in snapshot.processes if facts.pid == child.pid]
    # Without SPT_NOENV the title is written over the environment and the marker is gone.
    assert facts.owner == owner and owner.pid == os.getpid()
    assert owner in snapshot.live_owners
    assert facts.name == {"vllm": "VLLM::DPCoordinator", "ray": "ray::ServeReplica:app:engine"}[retitle]
    assert os.getpid() in snapshot.protected_pids


def test_a_listener_of_a_dead_owner_is_a_leftover_and_is_ended(started):
    port = reserve_port()
    dead = _dead_owner()
    child = _start(started, LISTENER, str(port),
                   env={**os.environ, OWNER_VARIABLE: dead.marker(), **KEEP_ENVIRON})
    snapshot = read_snapshot()
    assert dead not in snapshot.live_owners
    plan = snapshot.plan([PortNeed(port, "127.0.0.1", "the HTTP endpoint", "choose another")])
    [ours] = [left for left in plan.leftovers if left.process.pid == child.pid]
    assert ours.ports == (port,)
    assert not [conflict for conflict in plan.conflicts if conflict.need.port == port]
    assert end_processes([snapshot.handles[child.pid]], grace_s=1.0) == []  # ignores SIGTERM: killed
    assert child.wait(5) == -signal.SIGKILL


def test_a_foreign_listener_is_refused_and_left_alone(started):
    port = reserve_port()
    env = {key: value for key, value in os.environ.items() if key != OWNER_VARIABLE}
    child = _start(started, LISTENER, str(port), env=env)
    need = PortNeed(port, "127.0.0.1", "the HTTP endpoint, http.port", "set http.port in the manifest to a free port")
    plan = read_snapshot().plan([need])
    assert child.pid not in {left.process.pid for left in plan.leftovers}
    [line] = port_holders([need])
    assert line.startswith(f"port {port} (the HTTP endpoint, http.port) is in use by pid {child.pid} (`")
    assert f"which moe-serve did not start. Stop it (`kill {child.pid}`)" in line and "\n" not in line
    assert child.poll() is None


def test_start_ticks_agree_with_the_creation_time_even_when_the_name_has_parentheses(started):
    # A name with ") " in it: /proc/PID/stat's fields are counted after the last parenthesis.
    child = _start(started, RETITLED.format(retitle="import setproctitle; setproctitle.setproctitle('a) b (c d')"))
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    for pid in (os.getpid(), child.pid):
        created_s = psutil.Process(pid).create_time()
        assert abs(psutil.boot_time() + start_ticks(pid) / ticks_per_s - created_s) < 0.05
    assert psutil.Process(child.pid).name().startswith("a) b (c")


def test_an_owner_whose_pid_now_names_another_process_is_not_alive(owner_environment, started):
    owner = mark_owner()
    recycled = Owner(owner.pid, owner.started_ticks - 1)  # the same pid, started at another time
    child = _start(started, RETITLED.format(retitle=""), env={**os.environ, OWNER_VARIABLE: recycled.marker()})
    snapshot = read_snapshot()
    assert recycled not in snapshot.live_owners
    assert child.pid in {left.process.pid for left in snapshot.plan([]).leftovers}
