"""Simulated pools: replica lifecycle (shared) and the prefill pool's work. Decode: sim_decode.

Lifecycle of a replica: PENDING (waiting for free units) -> STARTING (placed, loading for
replica_startup_s) -> READY (serving) -> DRAINING (removed: finishes its work, takes no new)
-> GONE. Units are held from placement until GONE. Scale-in removes the least advanced first:
pending, then starting (newest first), then ready ones with the least work, which drain.

Prefill rule: one shared FIFO queue per pool (an ideal router); a ready replica prefills one
prompt at a time; when done the request leaves for decode after the KV hop.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from autoscaler.service_model import ServiceModel
from autoscaler.sim_metrics import SampleWindow, TimeAverage

PENDING, STARTING, READY, DRAINING, GONE = range(5)
# Event kinds on the simulator's heap.
PREFILL_DONE, DECODE_ARRIVE, DECODE_FINISH, REPLICA_READY = range(4)

Schedule = Callable[[float, int, object], None]  # (at_s, kind, payload)
Retire = Callable[["Replica", float], None]


class RequestBook:
    """Per-request facts, indexed by request id (plain lists: the hot path reads them)."""

    def __init__(self, arrival_s: list[float], prompt_tokens: list[int], output_tokens: list[int]):
        n = len(arrival_s)
        self.arrival_s, self.prompt_tokens, self.output_tokens = arrival_s, prompt_tokens, output_tokens
        self.first_token_s = [float("nan")] * n
        self.finish_s = [float("nan")] * n
        self.ttft_s = [float("nan")] * n
        self.itl_s = [float("nan")] * n
        self.completions = 0  # finish events; equals the number of distinct finished requests

    def finish(self, rid: int, now_s: float) -> float:
        assert self.finish_s[rid] != self.finish_s[rid], f"request {rid} finished twice"  # NaN until set
        tokens = self.output_tokens[rid]
        itl = (now_s - self.first_token_s[rid]) / (tokens - 1) if tokens > 1 else 0.0
        self.finish_s[rid], self.itl_s[rid] = now_s, itl
        self.completions += 1
        return itl


class Replica:
    __slots__ = ("rid", "pool", "state", "placed_s", "units")

    def __init__(self, rid: int, pool: Pool):
        self.rid, self.pool, self.state = rid, pool, PENDING
        self.placed_s: float | None = None
        self.units = pool.units_per_replica


class Pool:
    role = ""

    def __init__(self, name: str, units_per_replica: float, ranks_per_replica: int, model: ServiceModel,
                 book: RequestBook, schedule: Schedule, retire: Retire, window_s: float):
        self.name, self.units_per_replica, self.ranks_per_replica = name, units_per_replica, ranks_per_replica
        self.model, self.book, self._schedule, self._retire_cb = model, book, schedule, retire
        self.replicas: list[Replica] = []  # not GONE
        self.queue: deque[int] = deque()
        self.queue_gauge, self.running_gauge = TimeAverage(), TimeAverage()
        self.arrivals = SampleWindow(window_s)
        self._next_id = 0

    # --- lifecycle ---
    def new_replica(self) -> Replica:
        replica = self._make_replica(self._next_id)
        self._next_id += 1
        self.replicas.append(replica)
        return replica

    def start(self, replica: Replica, now_s: float, ready_now: bool = False) -> None:
        replica.state = STARTING
        if ready_now:
            self.on_ready(replica, now_s)
        else:
            self._schedule(now_s + self.model.replica_startup_s, REPLICA_READY, replica)

    def on_ready(self, replica: Replica, now_s: float) -> None:
        if replica.state != STARTING:  # removed while starting
            return
        replica.state = READY
        self._accept(replica, now_s)

    def active(self) -> list[Replica]:
        return [r for r in self.replicas if r.state in (PENDING, STARTING, READY)]

    def counts(self) -> tuple[int, int]:
        """(replicas, of which not serving yet): what a PoolObservation reports."""
        active = self.active()
        return len(active), sum(1 for r in active if r.state != READY)

    def remove(self, count: int, now_s: float) -> None:
        active = self.active()
        order = sorted(active, key=lambda r: (r.state, self._work(r) if r.state == READY else -r.rid))
        for replica in order[:count]:
            if replica.state == READY:
                self._drain(replica, now_s)
            else:
                self.retire(replica, now_s)

    def retire(self, replica: Replica, now_s: float) -> None:
        replica.state = GONE
        self.replicas.remove(replica)
        self._retire_cb(replica, now_s)

    # --- per role ---
    def _make_replica(self, rid: int) -> Replica:
        raise NotImplementedError

    def _accept(self, replica: Replica, now_s: float) -> None:
        raise NotImplementedError

    def _drain(self, replica: Replica, now_s: float) -> None:
        raise NotImplementedError

    def _work(self, replica: Replica) -> int:
        raise NotImplementedError


class PrefillReplica(Replica):
    __slots__ = ("current",)

    def __init__(self, rid: int, pool: Pool):
        super().__init__(rid, pool)
        self.current = -1  # request being prefilled, -1 when idle


class PrefillPool(Pool):
    role = "prefill"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.idle: list[PrefillReplica] = []  # ready and free; non-empty only while the queue is empty
        self.busy = 0
        self.ttft = SampleWindow(self.arrivals.window_s)  # end to end, stamped at the first token
        self.kv_transfer = SampleWindow(self.arrivals.window_s)

    def arrive(self, rid: int, now_s: float) -> None:
        self.arrivals.add(now_s, 1.0)
        if self.idle:
            self._serve(self.idle.pop(), rid, now_s)
        else:
            self.queue.append(rid)
            self.queue_gauge.set(now_s, len(self.queue))

    def on_done(self, replica: PrefillReplica, now_s: float) -> None:
        rid, replica.current = replica.current, -1
        self.busy -= 1
        self.running_gauge.set(now_s, self.busy)
        transfer_s = self.model.kv_transfer_s(self.book.prompt_tokens[rid])
        self.kv_transfer.add(now_s, transfer_s)
        self._schedule(now_s + transfer_s, DECODE_ARRIVE, rid)
        if replica.state == DRAINING:
            self.retire(replica, now_s)
        else:
            self._accept(replica, now_s)

    def _serve(self, replica: PrefillReplica, rid: int, now_s: float) -> None:
        replica.current = rid
        self.busy += 1
        self.running_gauge.set(now_s, self.busy)
        self._schedule(now_s + self.model.prefill_s(self.book.prompt_tokens[rid]), PREFILL_DONE, replica)

    def _make_replica(self, rid: int) -> PrefillReplica:
        return PrefillReplica(rid, self)

    def _accept(self, replica: PrefillReplica, now_s: float) -> None:
        if self.queue:
            self._serve(replica, self.queue.popleft(), now_s)
            self.queue_gauge.set(now_s, len(self.queue))
        else:
            self.idle.append(replica)

    def _drain(self, replica: PrefillReplica, now_s: float) -> None:
        if replica.current < 0:
            self.idle.remove(replica)
            self.retire(replica, now_s)
        else:
            replica.state = DRAINING

    def _work(self, replica: PrefillReplica) -> int:
        return 0 if replica.current < 0 else 1
