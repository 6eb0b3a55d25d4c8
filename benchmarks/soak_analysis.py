"""Pure analysis for benchmarks/bench_soak.py: memory growth per process and what each injected
fault cost. Plain data in, plain data out (no Ray, no HTTP), so it is unit-tested.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

MIB = 1024 * 1024
# A mapping at least this large, anonymous or in shared memory, is a preallocated arena: vLLM's
# CPU KV cache (cpu_kvcache_space_gib), a Mooncake segment (segment_mib), or the shared-memory
# ring buffers that carry scheduler output from vLLM's engine core to its workers (/dev/shm/psm_*,
# 160-240 MiB each, written chunk after chunk round the ring). Their pages become resident as
# they are first written, so their RSS climbs to their size under any long load: that is first
# use, not a leak. Heap, malloc arenas (64 MiB), files and smaller buffers stay in the count.
ARENA_MIN_BYTES = 150 * MIB
SHARED_MEMORY_PREFIXES = ("/dev/shm/", "/memfd:", "/SYSV")


def rss_outside_arenas(smaps: str, arena_min_bytes: int = ARENA_MIN_BYTES) -> tuple[int, int]:
    """(resident bytes outside preallocated arenas, resident bytes inside them) from the text of
    /proc/PID/smaps."""
    outside = inside = 0
    size = rss = 0
    named = False

    def close() -> None:
        nonlocal outside, inside
        if size >= arena_min_bytes and not named:
            inside += rss
        else:
            outside += rss

    started = False
    for line in smaps.splitlines():
        head = line.split(None, 1)[0] if line.strip() else ""
        if head and not head.endswith(":") and "-" in head:  # a mapping's header line
            if started:
                close()
            started, size, rss = True, 0, 0
            fields = line.split(None, 5)
            name = fields[5].strip() if len(fields) == 6 else ""
            named = bool(name) and not name.startswith(SHARED_MEMORY_PREFIXES)
        elif head == "Size:":
            size = int(line.split()[1]) * 1024
        elif head == "Rss:":
            rss = int(line.split()[1]) * 1024
    if started:
        close()
    return outside, inside


def rss_by_kind(smaps: str, arena_min_bytes: int = ARENA_MIN_BYTES) -> dict[str, int]:
    """Resident bytes of /proc/PID/smaps by kind of mapping, to say where a process grew:
    heap ([heap], glibc's main arena), anon (unnamed mappings under the arena size: malloc's
    other arenas and its mmap'd chunks, numpy and torch buffers), arena (preallocated, see
    ARENA_MIN_BYTES), shm (shared memory), file (code and mapped files), other ([stack], ...)."""
    out: dict[str, int] = {}
    kind, size = "other", 0
    for line in smaps.splitlines():
        head = line.split(None, 1)[0] if line.strip() else ""
        if head and not head.endswith(":") and "-" in head:
            fields = line.split(None, 5)
            name = fields[5].strip() if len(fields) == 6 else ""
            kind = ("heap" if name == "[heap]" else "shm" if name.startswith(SHARED_MEMORY_PREFIXES)
                    else "file" if name.startswith("/") else "other" if name else "anon")
        elif head == "Size:":
            size = int(line.split()[1]) * 1024
        elif head == "Rss:":
            rss = int(line.split()[1]) * 1024
            which = "arena" if size >= arena_min_bytes and kind in ("anon", "shm") else kind
            out[which] = out.get(which, 0) + rss
    return out


@dataclass(frozen=True)
class Sample:
    """Resident memory of every watched process at one moment: pid -> (label, bytes)."""
    at_s: float
    rss: Mapping[int, tuple[str, int]]


@dataclass(frozen=True)
class Growth:
    pid: int
    label: str
    start_mib: float
    end_mib: float

    @property
    def growth_mib(self) -> float:
        return self.end_mib - self.start_mib


def memory_growth(samples: Sequence[Sample], warm_until_s: float, edge: int = 3) -> list[Growth]:
    """Growth of each process alive from the end of warm-up to the last sample: the median of
    the first `edge` samples after warm-up against the median of the last `edge` (one sample
    catches a process mid-request; a median of three does not). Largest growth first."""
    window = [s for s in samples if s.at_s >= warm_until_s]
    if len(window) < 2 * edge:
        raise ValueError(f"need {2 * edge} samples after warm-up, have {len(window)}: run longer or sample more often")
    first, last = window[:edge], window[-edge:]
    survivors = set.intersection(*(set(s.rss) for s in window))  # restarted processes are not growth
    out = []
    for pid in survivors:
        label = window[0].rss[pid][0]
        start = statistics.median(s.rss[pid][1] for s in first) / MIB
        end = statistics.median(s.rss[pid][1] for s in last) / MIB
        out.append(Growth(pid, label, start, end))
    return sorted(out, key=lambda g: -g.growth_mib)


def growth_by_kind(samples: list[tuple[float, dict]], warm_until_s: float, pids: list[int]) -> dict[int, dict]:
    """For the processes that grew past the target outside arenas: growth (MiB) per kind of
    mapping (heap, anon, file, ...), so the report says where, not only how much."""
    out: dict[int, dict] = {}
    for pid in pids:
        kinds = sorted({kind for _, procs in samples if pid in procs for kind in procs[pid][1]})
        per_kind = {}
        for kind in kinds:
            series = [Sample(at, {pid: (procs[pid][0], procs[pid][1].get(kind, 0))}) for at, procs in samples
                      if pid in procs]
            per_kind[kind] = round(memory_growth(series, warm_until_s)[0].growth_mib, 1)
        out[pid] = per_kind
    return out


@dataclass(frozen=True)
class Outcome:
    """One request as the load generator saw it. `status`: the HTTP status, "error-event" (an SSE
    error after 200), or "no-answer" (connection failed or the client's timeout ran out)."""
    started_s: float
    ended_s: float
    status: int | str
    error_code: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def lost(self) -> bool:
        """Lost: no answer, or an error a client is not told it may retry (5xx other than
        503 "retry", a 504 timeout). A retriable 503 is an affected request, not a lost one."""
        if self.ok:
            return False
        if self.status == "no-answer":
            return True
        return self.error_code != "retry"


@dataclass(frozen=True)
class FaultReport:
    fault: str
    how: str
    affected: int  # requests in flight at the fault, or started before recovery, that did not succeed
    lost: int
    slowest_s: float  # the longest request among those: how long a client waited at worst
    first_success_s: float | None  # fault -> first success of a request started after it
    full_capacity_s: float | None  # fault -> every deployment serving with its replicas again

    def to_dict(self) -> dict:
        return asdict(self)


def fault_report(fault: str, how: str, outcomes: Sequence[Outcome], fault_at_s: float,
                 recovered_at_s: float | None) -> FaultReport:
    """What one fault cost: counted over requests that overlap [fault, recovery] (recovery:
    full capacity, or the end of the observations when it never came back)."""
    horizon = recovered_at_s if recovered_at_s is not None else max((o.ended_s for o in outcomes), default=fault_at_s)
    window = [o for o in outcomes if o.ended_s >= fault_at_s and o.started_s <= horizon]
    failed = [o for o in window if not o.ok]
    after = [o.ended_s - fault_at_s for o in outcomes if o.ok and o.started_s >= fault_at_s]
    slowest = max((o.ended_s - o.started_s for o in window), default=0.0)
    return FaultReport(fault, how, len(failed), sum(o.lost for o in failed), slowest, min(after, default=None),
                       None if recovered_at_s is None else recovered_at_s - fault_at_s)
