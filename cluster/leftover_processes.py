"""The adapter for cluster/leftovers.py: marks the process that starts a local cluster as its
owner, reads every process's marker and the listening sockets (psutil, i.e. /proc), and ends
the leftovers the plan names."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import psutil

from cluster.errors import ClusterError
from cluster.leftovers import (OWNER_VARIABLE, CleanupPlan, Leftover, Listener, Owner, PortNeed, ProcessFacts,
                               parse_marker, plan_cleanup)
from cluster.process_tree import end_processes

# Ray's workers and vLLM's processes retitle themselves (`ray::ServeReplica:...`,
# `VLLM::DPCoordinator`) with setproctitle, which by default writes the title over the memory
# the environment was passed in: /proc/PID/environ then no longer shows the marker (measured
# with Ray 2.60's `ray._raylet.setproctitle` and setproctitle 1.3.8). With this variable set,
# both keep the environment and cut a title to the command line's length (hundreds of
# characters for a Ray worker or a multiprocessing child, so titles stay whole).
KEEP_ENVIRON = {"SPT_NOENV": "1"}
# Rounds of read, plan, end: the second read sees what the first ending left (a child that
# started while its parent was being ended); the last round only reads.
_ROUNDS = 3


def mark_owner() -> Owner:
    """Make this process the owner of every process it starts from now on: each inherits the
    marker (and keeps it readable). Called before a local cluster's first process starts."""
    owner = Owner(os.getpid(), start_ticks(os.getpid()))
    os.environ[OWNER_VARIABLE] = owner.marker()
    os.environ.update(KEEP_ENVIRON)
    return owner


@dataclass
class Snapshot:
    processes: list[ProcessFacts] = field(default_factory=list)
    listeners: list[Listener] = field(default_factory=list)
    live_owners: set[Owner] = field(default_factory=set)
    protected_pids: set[int] = field(default_factory=set)
    # What to signal: psutil signals a pid only while it is still the process that was read.
    handles: dict[int, psutil.Process] = field(default_factory=dict)

    def plan(self, needs: Iterable[PortNeed]) -> CleanupPlan:
        return plan_cleanup(self.processes, self.listeners, needs, self.live_owners, self.protected_pids)


def read_snapshot() -> Snapshot:
    """Every process (zombies aside: they hold nothing), with its marker when it runs as this
    user, every listening TCP socket, and which of the markers' owners are alive."""
    snapshot = Snapshot()
    my_uid = os.getuid()
    for process in psutil.process_iter():
        try:
            with process.oneshot():
                if process.status() == psutil.STATUS_ZOMBIE:
                    continue
                name, cmdline, uid = process.name(), process.cmdline(), process.uids().real
            # Another user's processes are never ours to end, even for root.
            owner = parse_marker(_environ(process).get(OWNER_VARIABLE)) if uid == my_uid else None
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        title = " ".join(part for part in cmdline if part)
        shown = title if cmdline and "/" not in cmdline[0] and title else name  # a setproctitle title
        snapshot.processes.append(ProcessFacts(process.pid, shown, title, owner))
        snapshot.handles[process.pid] = process
    for owner in {facts.owner for facts in snapshot.processes if facts.owner is not None}:
        if _is_alive(owner):
            snapshot.live_owners.add(owner)
    try:
        sockets = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:  # some kernels hide /proc/net from unprivileged users
        sockets = []
    snapshot.listeners = [Listener(s.laddr.ip, s.laddr.port, s.pid) for s in sockets
                          if s.status == psutil.CONN_LISTEN and s.laddr]
    me = psutil.Process()
    snapshot.protected_pids = {me.pid, *(parent.pid for parent in me.parents())}
    return snapshot


def clear_leftovers(needs: Iterable[PortNeed], progress: Callable[[str], None] = print,
                    grace_s: float = 3.0) -> list[Leftover]:
    """End what a killed local cluster left running and check the `needs` ports are free; the
    leftovers ended. Says what it ended in one line per round (normally one). Raises
    ClusterError, one line per port, when a port is held by something not ours to end, or when a
    leftover outlived SIGKILL."""
    needs = list(needs)
    ended: list[Leftover] = []
    for round_index in range(_ROUNDS):
        snapshot = read_snapshot()
        plan = snapshot.plan(needs)
        if not plan.leftovers or round_index == _ROUNDS - 1:
            break
        end_processes([snapshot.handles[left.process.pid] for left in plan.leftovers], grace_s)
        progress(plan.ended_line())
        ended.extend(plan.leftovers)
    if plan.leftovers:
        pids = " ".join(str(left.process.pid) for left in plan.leftovers)
        raise ClusterError(f"could not end what a killed moe-serve left running: "
                           f"{', '.join(str(left) for left in plan.leftovers)}; end them with `kill -9 {pids}`")
    if plan.conflicts:
        raise ClusterError("\n".join(conflict.message for conflict in plan.conflicts))
    return ended


def port_holders(needs: Iterable[PortNeed]) -> list[str]:
    """One line per needed port held by anything but a leftover or this process's own cluster
    (nothing is ended)."""
    snapshot = read_snapshot()
    own = {facts.pid for facts in snapshot.processes
           if facts.owner is not None and facts.owner.pid == os.getpid()}
    return [conflict.message for conflict in snapshot.plan(needs).conflicts if conflict.pid not in own]


def _environ(process: psutil.Process) -> dict[str, str]:
    try:
        return process.environ()
    except (psutil.AccessDenied, psutil.ZombieProcess):
        return {}


def _is_alive(owner: Owner) -> bool:
    try:
        running = psutil.Process(owner.pid).status() != psutil.STATUS_ZOMBIE
        return running and start_ticks(owner.pid) == owner.started_ticks
    except (psutil.NoSuchProcess, OSError):
        return False


def start_ticks(pid: int) -> int:
    """When `pid` started, in clock ticks since boot: field 22 of /proc/PID/stat, counted after
    the command name, which is in parentheses and may itself hold spaces and parentheses."""
    with open(f"/proc/{pid}/stat", "rb") as stat:
        after_name = stat.read().rsplit(b")", 1)[1].split()
    return int(after_name[19])
