"""Discrete-event simulation of a disaggregated cluster (one prefill pool, one decode pool)
driven by a scaling policy. Deterministic: the same config, trace and policy give the same report.

Loop: take the earliest of (next arrival, next heap event, next control tick). Every
control_interval_s the pools report PoolObservations (p90 latencies over the trailing
metrics_window_s, queue and running averaged since the previous tick, metrics age 0) and the
policy's targets are applied: new replicas wait for free units (FIFO across pools; the cluster
has cluster_units), then start for replica_startup_s; removed ones drain. After the last
arrival the run goes on until every request finished (or drain_timeout_s passed).

Costs: a replica holds its units from placement to the end of its drain; unit-seconds per pool
are the report's "replica-seconds" (units x seconds, so a 2-node group costs twice a node).
Colocated pools are not simulated.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from autoscaler.errors import AutoscalerConfigError
from autoscaler.observations import PoolObservation, ScalingPolicy
from autoscaler.service_model import ServiceModel
from autoscaler.sim_decode import DecodePool
from autoscaler.sim_pools import (DECODE_ARRIVE, DECODE_FINISH, GONE, PREFILL_DONE, REPLICA_READY, PrefillPool,
                                  Replica, RequestBook)
from autoscaler.traces import Trace


@dataclass(frozen=True)
class SimPool:
    name: str
    initial_replicas: int  # ready at t=0
    units_per_replica: float = 1.0
    ranks_per_replica: int = 1


@dataclass(frozen=True)
class SimConfig:
    prefill: SimPool
    decode: SimPool
    model: ServiceModel
    cluster_units: float
    ttft_slo_s: float
    itl_slo_s: float
    control_interval_s: float = 15.0
    metrics_window_s: float = 60.0
    drain_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        initial = (self.prefill.initial_replicas * self.prefill.units_per_replica
                   + self.decode.initial_replicas * self.decode.units_per_replica)
        if initial > self.cluster_units + 1e-9:
            raise AutoscalerConfigError("SimConfig.initial_replicas", initial, "initial replicas need more units "
                                        f"than the cluster has ({self.cluster_units:g})", "start smaller")


@dataclass(frozen=True)
class SimReport:
    trace: str
    policy: str
    requests: int
    completed: int  # finish events; with unfinished == 0 and completed == requests, each finished once
    unfinished: int  # requests still unfinished when the run stopped (drain_timeout_s)
    slo_met: int
    duration_s: float  # of the trace
    end_s: float  # when the last request finished (>= duration_s)
    slo_attainment: float  # slo_met / requests
    goodput_rps: float  # slo_met / duration_s
    unit_seconds: dict[str, float]  # per pool: units x seconds held
    total_unit_seconds: float
    goodput_per_unit_s: float  # slo_met / total_unit_seconds
    ttft_p90_s: float
    itl_p90_s: float  # of per-request mean inter-token latency
    ttft_p50_s: float
    itl_p50_s: float
    scaling_changes: int  # decisions that changed a pool's target
    wall_s: float
    cpu_s: float  # process CPU time of the run: steadier than wall time on a shared machine
    timeline: list[dict] = field(default_factory=list)  # per tick: t and replicas per pool

    def summary(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "timeline"}


def simulate(config: SimConfig, trace: Trace, policy: ScalingPolicy, policy_name: str | None = None,
             progress: Callable[[str], None] | None = None) -> SimReport:
    return _Simulation(config, trace, policy, policy_name or type(policy).__name__).run(progress)


class _Simulation:
    def __init__(self, config: SimConfig, trace: Trace, policy: ScalingPolicy, policy_name: str):
        self.config, self.trace, self.policy, self.policy_name = config, trace, policy, policy_name
        self.book = RequestBook(trace.arrival_s.tolist(), trace.prompt_tokens.tolist(), trace.output_tokens.tolist())
        self.heap: list = []
        self._seq = itertools.count()
        self.free_units = config.cluster_units
        self.pending: deque[Replica] = deque()
        self.unit_seconds = {config.prefill.name: 0.0, config.decode.name: 0.0}
        common = dict(model=config.model, book=self.book, schedule=self.schedule, retire=self._on_retire,
                      window_s=config.metrics_window_s)
        self.prefill = PrefillPool(config.prefill.name, config.prefill.units_per_replica,
                                   config.prefill.ranks_per_replica, **common)
        self.decode = DecodePool(config.decode.name, config.decode.units_per_replica,
                                 config.decode.ranks_per_replica, ttft_window=self.prefill.ttft, **common)
        self.pools = {self.prefill.name: self.prefill, self.decode.name: self.decode}
        self.changes = 0
        self.timeline: list[dict] = []

    def schedule(self, at_s: float, kind: int, payload: object) -> None:
        heapq.heappush(self.heap, (at_s, next(self._seq), kind, payload))

    def run(self, progress: Callable[[str], None] | None) -> SimReport:
        started, started_cpu = time.perf_counter(), time.process_time()
        config, book, heap = self.config, self.book, self.heap
        for spec, pool in ((config.prefill, self.prefill), (config.decode, self.decode)):
            for _ in range(spec.initial_replicas):
                self._place(pool.new_replica(), 0.0, ready_now=True)
        arrivals, n = book.arrival_s, len(book.arrival_s)
        next_arrival, next_tick = 0, config.control_interval_s
        deadline = self.trace.duration_s + config.drain_timeout_s
        report_every, next_report = max(self.trace.duration_s / 10.0, 1.0), 0.0
        prefill, decode = self.prefill, self.decode
        now = 0.0
        while True:
            t_event = heap[0][0] if heap else math.inf
            t_arrival = arrivals[next_arrival] if next_arrival < n else math.inf
            now = min(t_event, t_arrival, next_tick)
            if now > deadline or (book.completions == n and now > self.trace.duration_s):
                break
            if now == t_arrival:
                prefill.arrive(next_arrival, now)
                next_arrival += 1
            elif now == t_event:
                _, _, kind, payload = heapq.heappop(heap)
                if kind == DECODE_FINISH:
                    decode.on_finish(payload[0], payload[1], now)
                elif kind == PREFILL_DONE:
                    prefill.on_done(payload, now)
                elif kind == DECODE_ARRIVE:
                    decode.arrive(payload, now)
                else:
                    assert kind == REPLICA_READY, kind
                    payload.pool.on_ready(payload, now)
            else:
                self._control(now)
                next_tick += config.control_interval_s
                if progress is not None and now >= next_report:
                    next_report += report_every
                    progress(f"{self.trace.name}/{self.policy_name}: t={now:.0f}s of {self.trace.duration_s:.0f}s, "
                             f"{book.completions}/{n} done, replicas {self._sizes()}")
        end_s = max(self.trace.duration_s, max((t for t in book.finish_s if t == t), default=0.0))
        return self._report(end_s, time.perf_counter() - started, time.process_time() - started_cpu)

    # --- control and placement ---
    def _observe(self, now_s: float) -> list[PoolObservation]:
        p, d = self.prefill, self.decode
        p_replicas, p_starting = p.counts()
        d_replicas, d_starting = d.counts()
        return [
            PoolObservation(p.name, "prefill", p_replicas, p.ranks_per_replica,
                            ttft_p90_s=p.ttft.p90(now_s), queue_depth=p.queue_gauge.take(now_s),
                            running=p.running_gauge.take(now_s), kv_transfer_s=p.kv_transfer.p90(now_s),
                            arrival_rps=p.arrivals.rate(now_s), starting_replicas=p_starting),
            PoolObservation(d.name, "decode", d_replicas, d.ranks_per_replica,
                            itl_p90_s=d.itl.p90(now_s), queue_depth=d.queue_gauge.take(now_s),
                            running=d.running_gauge.take(now_s), kv_cache_usage=d.kv_cache_usage(),
                            arrival_rps=d.arrivals.rate(now_s), starting_replicas=d_starting),
        ]

    def _control(self, now_s: float) -> None:
        decisions = self.policy.decide(self._observe(now_s), now_s)
        for decision in decisions.decisions:
            pool = self.pools[decision.pool]
            active = len(pool.active())
            if decision.target > active:
                for _ in range(decision.target - active):
                    self.pending.append(pool.new_replica())
                self._place_pending(now_s)
            elif decision.target < active:
                pool.remove(active - decision.target, now_s)
            self.changes += decision.target != decision.current
        self.timeline.append({"t": now_s, **self._sizes()})

    def _sizes(self) -> dict[str, int]:
        return {name: len(pool.active()) for name, pool in self.pools.items()}

    def _place(self, replica: Replica, now_s: float, ready_now: bool = False) -> None:
        self.free_units -= replica.units
        replica.placed_s = now_s
        replica.pool.start(replica, now_s, ready_now)

    def _place_pending(self, now_s: float) -> None:
        pending = self.pending
        while pending:
            head = pending[0]
            if head.state == GONE:  # removed before it was placed
                pending.popleft()
            elif head.units <= self.free_units + 1e-9:
                self._place(pending.popleft(), now_s)
            else:
                break

    def _on_retire(self, replica: Replica, now_s: float) -> None:
        if replica.placed_s is not None:
            self.free_units += replica.units
            self.unit_seconds[replica.pool.name] += replica.units * (now_s - replica.placed_s)
            self._place_pending(now_s)

    def _report(self, end_s: float, wall_s: float, cpu_s: float) -> SimReport:
        for pool in self.pools.values():
            for replica in pool.replicas:
                if replica.placed_s is not None:
                    self.unit_seconds[pool.name] += replica.units * (end_s - replica.placed_s)
        book, config = self.book, self.config
        ttft, itl = np.array(book.ttft_s), np.array(book.itl_s)
        finished = ~np.isnan(np.array(book.finish_s))
        met = int(np.sum(finished & (ttft <= config.ttft_slo_s) & (itl <= config.itl_slo_s)))
        n = len(book.arrival_s)
        total = sum(self.unit_seconds.values())
        return SimReport(
            trace=self.trace.name, policy=self.policy_name, requests=n, completed=book.completions,
            unfinished=int(n - finished.sum()), slo_met=met,
            duration_s=self.trace.duration_s, end_s=end_s, slo_attainment=met / n if n else 1.0,
            goodput_rps=met / self.trace.duration_s, unit_seconds=dict(self.unit_seconds), total_unit_seconds=total,
            goodput_per_unit_s=met / total if total else 0.0,
            ttft_p90_s=float(np.nanpercentile(ttft, 90)) if finished.any() else math.nan,
            itl_p90_s=float(np.nanpercentile(itl, 90)) if finished.any() else math.nan,
            ttft_p50_s=float(np.nanpercentile(ttft, 50)) if finished.any() else math.nan,
            itl_p50_s=float(np.nanpercentile(itl, 50)) if finished.any() else math.nan,
            scaling_changes=self.changes, wall_s=wall_s, cpu_s=cpu_s, timeline=self.timeline)
