"""What a killed `moe-serve up` left running, and which ports a new one cannot have: pure decisions.

A local cluster's processes that left their worker's process group (Serve's HAProxy, vLLM's
DP coordinator, the pool master under its actor, Prometheus in a session of its own) survive
when `moe-serve up` is SIGKILLed with its process group, as a crashed terminal does; seen 20
minutes later, still holding :8000 and 560 MB. The next `up` must end them, and must never
end anything else.

Rule: a process is ours when its environment carries OWNER_VARIABLE, which the owner (the
process that starts a local cluster: `moe-serve up`, a test session) sets in itself before it
starts anything, so every process of the cluster inherits it (Ray nodes pass their environment
to workers, workers to vLLM's processes and HAProxy). The value names the owner by pid and
start time. A process whose owner is no longer alive (gone, or its pid now another
process's) is a leftover, and is ended. A process of a live owner is another running cluster:
its ports are refused, it is never touched. A process without the variable is not ours:
refused, never touched. This process and its ancestors are never leftovers.

A needed port is refused when a process that is not a leftover listens on it at an address
that overlaps ours (the same address, or either side a wildcard). The adapter is
cluster/leftover_processes.py.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from cluster.manifest import Manifest

OWNER_VARIABLE = "MOE_SERVE_CLUSTER_OWNER"
_WILDCARDS = {"", "0.0.0.0", "::"}
_COMMAND_CHARS = 120


@dataclass(frozen=True)
class Owner:
    """The process that started a local cluster, as its marker names it: pid and start time in
    clock ticks since boot (/proc/PID/stat), exact and immune to wall-clock steps, unlike a
    creation time in seconds since the epoch, which moves when NTP steps the clock and would
    make a live owner look like a recycled pid. A pid with another start time is another process."""

    pid: int
    started_ticks: int

    def marker(self) -> str:
        return f"{self.pid}:{self.started_ticks}"


def parse_marker(value: str | None) -> Owner | None:
    """The owner a marker value names; None for no value or one not written by `Owner.marker`."""
    if not value:
        return None
    pid, _, started = value.partition(":")
    try:
        return Owner(int(pid), int(started))
    except ValueError:
        return None


@dataclass(frozen=True)
class ProcessFacts:
    """One process as the adapter read it."""

    pid: int
    name: str  # the process's name (`haproxy`, `VLLM::DPCoordinator`, `prometheus`)
    command: str  # its command line, space-joined
    owner: Owner | None  # from OWNER_VARIABLE in its environment; None: not ours (or unreadable)


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket; pid None when this user cannot see whose it is."""

    host: str
    port: int
    pid: int | None


@dataclass(frozen=True)
class PortNeed:
    """A fixed port the new cluster will bind, with what it is for and how to choose another."""

    port: int
    host: str
    purpose: str  # e.g. "the HTTP endpoint (http.port)"
    other_port: str  # e.g. "set http.port in the manifest to a free port"


@dataclass(frozen=True)
class Leftover:
    process: ProcessFacts
    ports: tuple[int, ...]  # where it listens (for the report: which port it was holding)

    def __str__(self) -> str:
        held = f", :{', :'.join(str(p) for p in self.ports)}" if self.ports else ""
        return f"{self.process.name} (pid {self.process.pid}{held})"


@dataclass(frozen=True)
class PortConflict:
    """A needed port held by something that is not a leftover: the one line that says what
    holds it and how to free it."""

    need: PortNeed
    pid: int | None
    message: str


@dataclass(frozen=True)
class CleanupPlan:
    leftovers: tuple[Leftover, ...]  # to end (SIGTERM, then SIGKILL after a grace)
    conflicts: tuple[PortConflict, ...]  # each refuses the start

    def ended_line(self) -> str:
        """One line for the user about the leftovers ended."""
        owners = sorted({left.process.owner.pid for left in self.leftovers if left.process.owner})
        by = ", ".join(f"pid {pid}" for pid in owners)
        return (f"ended {len(self.leftovers)} process(es) left running by a moe-serve that is gone ({by}): "
                + ", ".join(str(left) for left in self.leftovers))


def plan_cleanup(processes: Iterable[ProcessFacts], listeners: Iterable[Listener], needs: Iterable[PortNeed],
                 live_owners: Iterable[Owner], protected_pids: Iterable[int] = ()) -> CleanupPlan:
    """Which processes to end and which needed ports to refuse (see the module's rule).

    `live_owners`: the owners (from the processes' markers) that are still the process they
    name; `protected_pids`: this process and its ancestors."""
    by_pid = {process.pid: process for process in processes}
    listeners = list(listeners)
    live = set(live_owners)
    protected = set(protected_pids)
    leftover_pids = {pid for pid, process in by_pid.items()
                     if process.owner is not None and process.owner not in live and pid not in protected}
    leftovers = tuple(Leftover(by_pid[pid], tuple(sorted({l.port for l in listeners if l.pid == pid})))
                      for pid in sorted(leftover_pids))
    conflicts: list[PortConflict] = []
    for need in needs:
        holders: list[int | None] = []
        for listener in listeners:
            if listener.port == need.port and _hosts_meet(listener.host, need.host) \
                    and listener.pid not in leftover_pids and listener.pid not in holders:
                holders.append(listener.pid)
        conflicts.extend(PortConflict(need, pid, _conflict_line(need, pid, by_pid)) for pid in holders)
    return CleanupPlan(leftovers, tuple(conflicts))


def _conflict_line(need: PortNeed, pid: int | None, by_pid: dict[int, ProcessFacts]) -> str:
    where = f"port {need.port} ({need.purpose})"
    holder = by_pid.get(pid) if pid is not None else None
    if pid is None:
        # Another user's process: the kernel does not say whose a socket is to other users.
        return (f"{where} is in use by a process this user cannot see; `sudo ss -ltnp 'sport = :{need.port}'` "
                f"names it. Stop it, or {need.other_port}")
    if holder is None:  # a process whose details could not be read (it may have just exited)
        return f"{where} is in use by pid {pid}. Stop it (`kill {pid}`), or {need.other_port}"
    held_by = f"pid {pid} (`{_short(holder.command or holder.name)}`)"
    if holder.owner is None:
        return (f"{where} is in use by {held_by}, which moe-serve did not start. "
                f"Stop it (`kill {pid}`), or {need.other_port}")
    owner = by_pid.get(holder.owner.pid)
    started_by = f"pid {holder.owner.pid}" + (f" (`{_short(owner.command)}`)" if owner else "")
    return (f"{where} is in use by {held_by} of a moe-serve cluster that is still running, "
            f"started by {started_by}. Stop that one first (Ctrl-C in its terminal, or `kill -INT {holder.owner.pid}`), or {need.other_port}")


def _short(command: str) -> str:
    """The command on one line (a `python -c` program has newlines), cut to a readable length."""
    command = " ".join(command.split())
    return command if len(command) <= _COMMAND_CHARS else command[:_COMMAND_CHARS - 3] + "..."


def _hosts_meet(a: str, b: str) -> bool:
    """Whether binding `b` collides with a listener on `a` (Linux: a wildcard listener, IPv6's
    dual-stack one included, takes the port on every address)."""
    if a in _WILDCARDS or b in _WILDCARDS:
        return True
    return _canonical(a) == _canonical(b)


def _canonical(host: str) -> str:
    if host == "localhost":
        return "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 is 127.0.0.1
    return str(mapped or address)


def up_port_needs(manifest: Manifest, gcs_port: int, dashboard_port: int, prometheus: bool) -> list[PortNeed]:
    """The fixed ports `moe-serve up` binds for `manifest`. HAProxy's stats and exporter ports,
    the engines' KV and KV-event ports and an unset pool master's ports are picked free at start,
    so they are not needed here (a leftover holding one is ended all the same)."""
    http = manifest.http
    needs = [PortNeed(http.port, http.host, "the HTTP endpoint, http.port",
                      "set http.port in the manifest to a free port"),
             PortNeed(gcs_port, "127.0.0.1", "Ray's GCS", "pass --gcs-port with a free port"),
             PortNeed(dashboard_port, "127.0.0.1", "Ray's dashboard", "pass --dashboard-port with a free port")]
    if prometheus:
        needs.append(PortNeed(manifest.observability.prometheus_port, "127.0.0.1", "Prometheus",
                              "set observability.prometheus_port to a free port, or pass --no-prometheus"))
    pool = manifest.kv_pool
    if pool.enabled:
        fixed = ((pool.master_rpc_port, "the KV pool master's RPC", "kv_pool.master_rpc_port"),
                 (pool.master_http_port, "the KV pool master's metadata", "kv_pool.master_http_port"))
        needs.extend(PortNeed(port, "127.0.0.1", f"{purpose}, {field}", f"set {field} to a free port or remove it")
                     for port, purpose, field in fixed if port is not None)
    return needs
