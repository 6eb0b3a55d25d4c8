"""Where the CPU goes while a server is under load: CPU seconds of every process on the machine
between two snapshots, grouped by the part of the serving path each process is.

A sampling profiler (py-spy) says which functions of one process are hot; this says which
processes pay per request, which is the question when a request crosses an HTTP proxy, an
ingress replica, an engine replica and an engine core: `(user + system) CPU seconds / requests`
per part, for every part at once, with nothing attached to the processes. The benchmark client
has ended by the second snapshot, so its CPU is not counted: what is left is the server's.
"""

from __future__ import annotations

import re

# (part, pattern on the process's command line or title); the first match names the part.
# Ray sets worker titles to `ray::<ActorClass>` or, for Serve replicas,
# `ray::ServeReplica:<app>:<deployment>`; vLLM names its processes `VLLM::...`.
PARTS: list[tuple[str, re.Pattern]] = [
    ("HAProxy", re.compile(r"(^|/)haproxy\b")),
    ("Serve HTTP proxy", re.compile(r"ProxyActor|HAProxyManager")),
    ("ingress replica", re.compile(r"ServeReplica:[^:]*:(openai-ingress|OpenAiIngress|LLMRouter|OpenAi)")),
    ("engine replica (Python)", re.compile(r"ServeReplica:")),
    ("engine core + workers (vLLM)", re.compile(r"VLLM::|EngineCore|vllm\.entrypoints\.openai\.api_server")),
    ("Ray (raylet, GCS, controller, agents)", re.compile(
        r"raylet|gcs_server|ServeController|dashboard|runtime_env|log_monitor|monitor\.py|ray::")),
]
OTHER = "other"


def part_of(command: str) -> str:
    for part, pattern in PARTS:
        if pattern.search(command):
            return part
    return OTHER


def cpu_by_part(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per part between two snapshots ({pid: (command, cpu seconds)}). A process that
    started in between counts from zero; one that ended in between is not seen (its last
    seconds are lost: keep snapshots around one measurement, with the servers already up)."""
    out: dict[str, float] = {}
    for pid, (command, seconds) in after.items():
        start = before.get(pid, (command, 0.0))[1]
        spent = max(0.0, seconds - start)
        if spent:
            part = part_of(command)
            out[part] = out.get(part, 0.0) + spent
    return out


def per_request_ms(by_part: dict[str, float], requests: int) -> dict[str, float]:
    """CPU milliseconds per request for each part, and their total."""
    if requests <= 0:
        raise ValueError("no requests completed: nothing to divide by")
    out = {part: 1e3 * seconds / requests for part, seconds in sorted(by_part.items())}
    out["total"] = sum(out.values())
    return out


def snapshot() -> dict[int, tuple[str, float]]:
    """{pid: (command line or title, user + system CPU seconds)} for every process readable now."""
    import psutil

    out = {}
    for proc in psutil.process_iter(["pid", "name", "cmdline", "cpu_times"]):
        info = proc.info
        times = info.get("cpu_times")
        if times is None:
            continue
        command = " ".join(info.get("cmdline") or []) or (info.get("name") or "")
        out[info["pid"]] = (command, times.user + times.system)
    return out
