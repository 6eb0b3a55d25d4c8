"""Every process a local Ray node started, so that stopping the node leaves none behind.

Ray ends a worker's children by process group (cluster/ray_node_env.py): measured here, a plain
child of a detached actor is gone after a graceful stop of the cluster and after its node is
killed. A process that left the group (a new session) is beyond that, and so is anything still
starting when its raylet went. We found one vLLM DP coordinator (~0.5 GiB) alive on this
machine after runs had stopped, without pinning down which stop left it (the `moe-serve up`
SIGTERM path, fixed since, is the likely one). So the cluster notes the process tree under
each node before stopping it and, once Ray's own shutdown has returned and its workers have
had a few seconds to exit, ends whatever of that tree is still alive. Processes are identified
by pid and creation time (psutil), so a pid reused by an unrelated process is never signalled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import psutil

logger = logging.getLogger(__name__)


def process_tree(root_pids: Iterable[int]) -> list[psutil.Process]:
    """The processes with these pids and all their descendants, as alive now."""
    found: dict[int, psutil.Process] = {}
    for pid in root_pids:
        try:
            root = psutil.Process(pid)
            for process in [root, *root.children(recursive=True)]:
                found[process.pid] = process
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def end_survivors(processes: Iterable[psutil.Process], exit_wait_s: float = 5.0, grace_s: float = 3.0) -> list[str]:
    """Give `processes` `exit_wait_s` to exit on their own (a Ray worker notices its raylet is
    gone within a few seconds), then terminate those still running, kill any that outlive
    `grace_s`, and return their descriptions (name and pid) for the log. `is_running()`
    compares creation times, so a recycled pid is left alone."""
    _, alive = psutil.wait_procs([process for process in processes if process.is_running()], timeout=exit_wait_s)
    described = []
    for process in alive:
        try:
            described.append(f"{process.name()} (pid {process.pid})")
        except psutil.NoSuchProcess:
            continue
    end_processes(alive, grace_s)
    if described:
        logger.warning("ended %d process(es) left running by the stopped Ray node(s): %s",
                       len(described), ", ".join(described))
    return described


def end_processes(processes: Iterable[psutil.Process], grace_s: float = 3.0) -> list[psutil.Process]:
    """SIGTERM `processes`, SIGKILL those still alive after `grace_s`, and wait up to `grace_s`
    more for them to be gone; the ones that are not (a process stuck in the kernel). psutil
    refuses to signal a pid that now belongs to another process (it compares creation times).
    A zombie counts as gone: it holds no memory and no socket, and a process orphaned in a
    container whose init does not reap stays one for good."""
    alive = [process for process in processes if _alive(process)]
    for process in alive:
        _signal(process, psutil.Process.terminate)
    stubborn = _wait_gone(alive, grace_s)
    for process in stubborn:
        _signal(process, psutil.Process.kill)
    return _wait_gone(stubborn, grace_s)


def _signal(process: psutil.Process, send) -> None:
    try:
        send(process)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass  # gone already, or not ours to signal: _wait_gone reports it if it stays


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(processes: list[psutil.Process], timeout_s: float, poll_s: float = 0.05) -> list[psutil.Process]:
    deadline_s = time.monotonic() + timeout_s
    alive = [process for process in processes if _alive(process)]
    while alive and time.monotonic() < deadline_s:
        time.sleep(poll_s)
        alive = [process for process in alive if _alive(process)]
    return alive
