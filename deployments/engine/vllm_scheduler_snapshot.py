"""The latest scheduler state of one vLLM engine (waiting, running, KV cache usage), for export.

vLLM hands every stat logger the scheduler's stats after each engine step. Its own Prometheus
logger has no notion of our pools, so this logger keeps the newest numbers where the engine
server can read them and export them per pool and rank: the waiting count is the pool's real
queue (Serve's handle queue stays empty because replicas admit far more than one batch).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class SchedulerSnapshot:
    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    updated_at: float = 0.0  # time.time() of the last engine step that reported; 0: none yet

    def update(self, waiting: int, running: int, kv_cache_usage: float) -> None:
        self.waiting, self.running, self.kv_cache_usage = waiting, running, kv_cache_usage
        self.updated_at = time.time()


def snapshot_logger(snapshot: SchedulerSnapshot) -> type:
    """A vLLM stat logger class (vLLM instantiates it per engine) writing into `snapshot`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SchedulerSnapshotLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self._snapshot = snapshot

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                self._snapshot.update(scheduler_stats.num_waiting_reqs, scheduler_stats.num_running_reqs,
                                      scheduler_stats.kv_cache_usage)

        def log_engine_initialized(self):
            pass

    return SchedulerSnapshotLogger
