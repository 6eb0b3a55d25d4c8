"""The simulated decode pool: continuous batching without per-token events.

Rule: a decode replica with b running sequences completes one step every decode_step_s(b)
seconds and each step emits one token per sequence. Between admissions and completions b is
constant, so the replica keeps a step counter `steps` (fractional, advanced lazily by elapsed
time / step time) and each sequence finishes at step (steps at admission + output tokens). A
per-replica min-heap of finish steps gives the next completion; one event is scheduled per
replica for it and re-scheduled (versioned, stale ones ignored) whenever b changes. Work per
request: O(log n) for its admission and its completion, however many tokens it emits.

A new request goes to the ready replica with the fewest running sequences that has room (fewer
than max_batch, and KV cache for prompt + output); if none has room, or others already wait,
it waits in the pool's FIFO queue, pulled by replicas as sequences finish. Its first token
comes one step after admission (TTFT includes any wait for a decode slot); its ITL is the mean
gap between its first and last token.
"""

from __future__ import annotations

import heapq

from autoscaler.sim_pools import DECODE_FINISH, DRAINING, GONE, READY, Pool, Replica
from autoscaler.sim_metrics import SampleWindow


class DecodeReplica(Replica):
    __slots__ = ("steps", "last_s", "batch", "seqs", "version", "reserved_tokens")

    def __init__(self, rid: int, pool: Pool):
        super().__init__(rid, pool)
        self.steps = 0.0  # steps completed as of last_s
        self.last_s = 0.0
        self.batch = 0
        self.seqs: list[tuple[float, int]] = []  # (finish step, request id), min-heap
        self.version = 0
        self.reserved_tokens = 0


class DecodePool(Pool):
    role = "decode"

    def __init__(self, *args, ttft_window: SampleWindow, **kwargs):
        super().__init__(*args, **kwargs)
        self.accepting: list[DecodeReplica] = []  # READY replicas
        self.running = 0
        self.ttft_window = ttft_window  # the prefill pool's: TTFT is observed end to end
        self.itl = SampleWindow(self.arrivals.window_s)

    def arrive(self, rid: int, now_s: float) -> None:
        self.arrivals.add(now_s, 1.0)
        if not self.queue:
            replica = self._pick(self._tokens(rid))
            if replica is not None:
                self._admit(replica, rid, now_s)
                self._reschedule(replica)
                return
        self.queue.append(rid)
        self.queue_gauge.set(now_s, len(self.queue))

    def on_finish(self, replica: DecodeReplica, version: int, now_s: float) -> None:
        if version != replica.version or replica.state == GONE:
            return
        self._advance(replica, now_s)
        book, seqs = self.book, replica.seqs
        while seqs and seqs[0][0] <= replica.steps + 1e-6:
            _, rid = heapq.heappop(seqs)
            replica.batch -= 1
            replica.reserved_tokens -= self._tokens(rid)
            self.running -= 1
            self.itl.add(now_s, book.finish(rid, now_s))
        self.running_gauge.set(now_s, self.running)
        if replica.state == READY:
            self._fill(replica, now_s)
        if replica.state == DRAINING and replica.batch == 0:
            self.retire(replica, now_s)
        else:
            self._reschedule(replica)

    def kv_cache_usage(self) -> float | None:
        if not self.accepting:
            return None
        return sum(r.reserved_tokens for r in self.accepting) / (len(self.accepting) * self.model.kv_capacity_tokens)

    def _tokens(self, rid: int) -> int:
        return self.book.prompt_tokens[rid] + self.book.output_tokens[rid]

    def _pick(self, tokens: int) -> DecodeReplica | None:
        best, max_batch, capacity = None, self.model.max_batch, self.model.kv_capacity_tokens
        for replica in self.accepting:
            if replica.batch < max_batch and replica.reserved_tokens + tokens <= capacity \
                    and (best is None or replica.batch < best.batch):
                best = replica
        return best

    def _advance(self, replica: DecodeReplica, now_s: float) -> None:
        if replica.batch:
            replica.steps += (now_s - replica.last_s) / self.model.decode_step_s(replica.batch)
        replica.last_s = now_s

    def _admit(self, replica: DecodeReplica, rid: int, now_s: float) -> None:
        self._advance(replica, now_s)
        replica.batch += 1
        replica.reserved_tokens += self._tokens(rid)
        heapq.heappush(replica.seqs, (replica.steps + self.book.output_tokens[rid], rid))
        first_token_s = now_s + self.model.decode_step_s(replica.batch)
        book = self.book
        book.first_token_s[rid] = first_token_s
        book.ttft_s[rid] = first_token_s - book.arrival_s[rid]
        self.ttft_window.add(now_s, book.ttft_s[rid])
        self.running += 1
        self.running_gauge.set(now_s, self.running)

    def _fill(self, replica: DecodeReplica, now_s: float) -> None:
        queue, max_batch, capacity = self.queue, self.model.max_batch, self.model.kv_capacity_tokens
        admitted = False
        while queue and replica.batch < max_batch and replica.reserved_tokens + self._tokens(queue[0]) <= capacity:
            self._admit(replica, queue.popleft(), now_s)
            admitted = True
        if admitted:
            self.queue_gauge.set(now_s, len(queue))

    def _reschedule(self, replica: DecodeReplica) -> None:
        replica.version += 1
        if replica.batch:
            step_s = self.model.decode_step_s(replica.batch)
            at_s = replica.last_s + (replica.seqs[0][0] - replica.steps) * step_s
            self._schedule(at_s, DECODE_FINISH, (replica, replica.version))

    def _make_replica(self, rid: int) -> DecodeReplica:
        return DecodeReplica(rid, self)

    def _accept(self, replica: DecodeReplica, now_s: float) -> None:
        replica.last_s = now_s
        self.accepting.append(replica)
        self._fill(replica, now_s)
        self._reschedule(replica)

    def _drain(self, replica: DecodeReplica, now_s: float) -> None:
        self.accepting.remove(replica)
        if replica.batch == 0:
            self.retire(replica, now_s)
        else:
            replica.state = DRAINING

    def _work(self, replica: DecodeReplica) -> int:
        return replica.batch
