"""An expert-parallel engine group: one Serve replica = N vLLM ranks on N placement-group bundles.

Rank 0 runs inside this replica (bundle 0, where Serve put it); ranks 1..N-1 are Ray actors
(LLMServer, the same server class) pinned to bundles 1..N-1 of the replica's placement group,
so the manifest's placement strategy spreads them over nodes. This replica does the rank
assignment and rendezvous (rank 0's address and a free RPC port), routes each request to one
rank (expert_ranks.pick_rank) and relays its stream.

Each rank has its own KV cache (attention is data-parallel). With the pool's `prefix` routing
and prefix caching on, every rank follows its engine's KV events; the group reports the union
of their caches to the pool's request router (so the group that holds a prompt's prefix gets
it) and sends the request on to the rank that holds the most of it, unless that rank is
RANK_AFFINITY_SLACK requests busier than the least loaded one.

Gang semantics: the ranks of a group are only useful together (every MoE layer is a
collective over all of them). When any rank dies, the group is broken: every in-flight request
fails at once with a retriable error (surviving ranks would otherwise wait inside a collective
for a peer that is gone), new requests are refused, and check_health fails so Serve replaces
the whole replica; its rank actors die with it (Ray kills actors whose owner is gone).

A rank that is alive but hung (stuck in a collective, an engine that stopped stepping) does not
end the never-ending call the death watchdog holds, so two more things look for it:
- each request's waits are bounded (the manifest's request_timeouts): past the first-token or
  inter-token bound the request fails (a WaitExpired value) and is aborted on its rank, whether
  or not the caller's cancellation ever arrives;
- check_health (Serve calls it every few seconds) asks every remote rank for its health within
  RANK_HEALTH_TIMEOUT_S, and treats the group as hung when a request expired at a stall bound
  (prefill, first token, inter-token) and no rank has produced anything since (StallWatch). A
  hung group is broken like one with a dead rank: Serve replaces the replica.
`rank_failure_timeout_s` bounds how long a cancelled request waits for its rank to let go.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from deployments.background import Background
from deployments.engine.llm_server import ABORT_GRACE_S, LLMServer, _node_ip
from deployments.engine.observed_fields import ObservedFields
from deployments.expert_parallel.expert_ranks import (group_stats, leading_hits, merge_expert_load,
                                                      merge_routing_stats, pick_rank, rank_engine_spec)
from deployments.expert_parallel.group_start import ray_start_failure, start_local_rank
from deployments.expert_parallel.rank_handles import LocalRank, RemoteRank, close_stream, ray_cancel, ray_rank_factory
from deployments.ports import reserve_port
from deployments.routing.block_hashes import prompt_block_hashes
from deployments.records import EngineFailure, EngineRequest, PrefillResult, ServerStats, TokenDelta, WaitExpired
from deployments.stream_deadlines import RequestTimeouts, StreamDeadlines, result_within, wait_expired
from kv_transfer.params import TransferParams

logger = logging.getLogger(__name__)


class GroupBroken(RuntimeError):
    """A rank of this engine group died or hung; the group cannot serve until Serve replaces it."""


# Expired waits that mean the engine stopped making progress (total_timeout_s caps a request
# that was progressing, so it says nothing about the group's health).
STALL_WAITS = frozenset({"prefill", "first_token", "inter_token"})
# How long a remote rank gets to answer the group's health check: far above the event-loop lag
# of a busy rank (seconds on a loaded 2-core machine), below the 60 s health-check timeout the
# builder gives Serve.
RANK_HEALTH_TIMEOUT_S = 20.0
# How long a routing report waits for a rank (Serve asks every second or so; a late one is skipped).
RANK_REPORT_TIMEOUT_S = 2.0


class StallWatch:
    """Whether the group has stalled: a request expired at a stall bound and nothing (a token, a
    finished prefill) came from any rank afterwards. Plain times in, a verdict out."""

    def __init__(self) -> None:
        self.last_progress_s: float | None = None
        self.stalled_since_s: float | None = None  # the first stall expiry not followed by progress

    def progress(self, now_s: float) -> None:
        self.last_progress_s = now_s
        self.stalled_since_s = None

    def expired(self, wait: str, now_s: float) -> None:
        if wait in STALL_WAITS and self.stalled_since_s is None:
            self.stalled_since_s = now_s

    def verdict(self, now_s: float) -> str | None:
        """Why the group counts as hung, or None."""
        if self.stalled_since_s is None:
            return None
        return (f"hung: a request expired at a stall bound {now_s - self.stalled_since_s:.0f}s ago and no rank "
                "has produced anything since")


class ExpertParallelGroup:
    """`expert_parallel`: the pool's ExpertParallelSpec as a dict; `rank_options`: Ray actor
    options for ranks 1..N-1 (their CPUs/GPUs and environment); `accelerator`: cpu or gpu."""

    def __init__(self, model: dict, engine: dict, model_path: str, kv_transfer: dict | None,
                 expert_parallel: dict, rank_options: dict, accelerator: str,
                 pool_name: str = "engine", remote_rank_factory: Callable[..., Any] | None = None,
                 local_server_factory: Callable[..., Any] = LLMServer, metrics: bool = True,
                 metrics_backend: Any = None, cancel_remote: Callable[[Any], None] | None = None,
                 request_timeouts: dict | None = None,
                 remote_start_failure: Callable[[], str | None] | None = None, kv_events: bool = False):
        from monitoring.exporter import MetricsExporter

        self._exporter = MetricsExporter(metrics, metrics_backend)
        self._timeouts = RequestTimeouts.of(request_timeouts)
        self._size = int(expert_parallel["size"])
        self._failure_timeout_s = float(expert_parallel.get("rank_failure_timeout_s", 5.0))
        self._pool = pool_name
        self._background = Background(logger)
        address = _node_ip()
        rpc_port = reserve_port(address)  # bound later by the ranks' vLLM processes

        def spec(rank: int) -> dict:
            return rank_engine_spec(engine, size=self._size, rank=rank, address=address, rpc_port=rpc_port,
                                    accelerator=accelerator, enable_eplb=expert_parallel.get("enable_eplb", False),
                                    num_redundant_experts=expert_parallel.get("num_redundant_experts", 0))

        started = time.monotonic()
        factory = remote_rank_factory or ray_rank_factory(rank_options)
        # Ranks 1..N-1 start first: rank 0's engine waits in its constructor until every rank
        # has joined the handshake it hosts (vLLM allows 5 minutes).
        # Each rank follows its own engine's KV events (same node as its engine: loopback).
        events = {"kv_events": True} if kv_events else {}
        self._remote = [factory(rank, model, spec(rank), model_path, kv_transfer, pool=pool_name, metrics=metrics,
                                request_timeouts=request_timeouts, **events) for rank in range(1, self._size)]
        self._local = start_local_rank(
            lambda: local_server_factory(model, spec(0), model_path, kv_transfer, pool=pool_name, rank=0,
                                         metrics=metrics, request_timeouts=request_timeouts, **events),
            remote_start_failure or ray_start_failure(self._remote))
        self._ranks = [LocalRank(self._local)] + [RemoteRank(actor, cancel_remote or ray_cancel)
                                                   for actor in self._remote]
        self._in_flight = [0] * self._size
        # What each rank's prefix cache holds (router block hashes), from the last routing report.
        self._rank_caches: list[frozenset[int]] = [frozenset()] * self._size
        self._cache_block_size: int | None = None
        self._stall = StallWatch()
        self._broken: str | None = None
        self._broken_event = asyncio.Event()
        self._watchdog: asyncio.Task | None = None
        from monitoring.exporter import CounterMirror

        self._expert_mirror = CounterMirror(self._exporter)
        self._observed = ObservedFields(logger)
        logger.info("engine group of %d ranks ready in %.1fs (rank 0 at %s:%d)", self._size,
                    time.monotonic() - started, address, rpc_port)

    # -- requests -----------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta | EngineFailure]:
        self._ensure_watchdog()
        if self._broken:
            yield self._failure()
            return
        rank = self._route(request)
        stream = self._ranks[rank].generate(request).__aiter__()
        broken = asyncio.ensure_future(self._broken_event.wait())
        step: asyncio.Future | None = None
        deadlines = StreamDeadlines(self._timeouts.for_prompt(len(request.prompt_token_ids)), time.monotonic())
        try:
            while True:
                step = asyncio.ensure_future(stream.__anext__())
                done, _ = await asyncio.wait({step, broken}, timeout=max(deadlines.next()[0] - time.monotonic(), 0.0),
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:  # the rank is alive but silent past a bound: give up (the finally aborts it)
                    expired = deadlines.expired()
                    self._stall.expired(expired.wait, time.monotonic())
                    yield expired
                    return
                if step not in done:  # a rank died: this rank may be stuck in a collective
                    yield self._failure()
                    return
                try:
                    item = step.result()
                except StopAsyncIteration:
                    return
                except Exception as exc:  # the rank serving this request died under it
                    self._mark_broken(f"rank {rank} failed: {type(exc).__name__}: {str(exc)[:200]}")
                    yield self._failure()
                    return
                now = time.monotonic()
                deadlines.seen(item, now)
                if isinstance(item, WaitExpired):  # the rank itself gave up on a bound
                    self._stall.expired(item.wait, now)
                elif not isinstance(item, EngineFailure):
                    self._stall.progress(now)
                yield item
        finally:
            broken.cancel()
            self._in_flight[rank] -= 1
            if step is not None and not step.done():
                # Cancelling the pending step makes the rank abort the request in its engine.
                step.cancel()
                await asyncio.wait({step}, timeout=self._failure_timeout_s)
            await close_stream(stream)

    async def prefill(self, request: EngineRequest) -> PrefillResult | EngineFailure:
        self._ensure_watchdog()
        if self._broken:
            return self._failure()
        rank = self._route(request)
        call = asyncio.ensure_future(self._ranks[rank].prefill(request))
        call.add_done_callback(lambda _: self._finished_on(rank))
        # The rank bounds the prefill itself (and aborts it); this bound is for a rank that hangs.
        prefill_timeout_s = self._timeouts.for_prompt(len(request.prompt_token_ids)).prefill_timeout_s
        limit_s = prefill_timeout_s + 2 * ABORT_GRACE_S + self._failure_timeout_s
        try:
            if not await result_within(call, limit_s):
                call.add_done_callback(self._release_when_done)  # a lease it ends up with is freed
                self._stall.expired("prefill", time.monotonic())
                return wait_expired("prefill", prefill_timeout_s)
            result = call.result()
            if isinstance(result, WaitExpired):
                self._stall.expired(result.wait, time.monotonic())
            elif isinstance(result, PrefillResult):
                self._stall.progress(time.monotonic())
            return result
        except asyncio.CancelledError:
            call.add_done_callback(self._release_when_done)
            raise
        except Exception as exc:
            self._mark_broken(f"rank {rank} failed: {type(exc).__name__}: {str(exc)[:200]}")
            return self._failure()

    def _finished_on(self, rank: int) -> None:
        self._in_flight[rank] -= 1

    def _release_when_done(self, call: asyncio.Future) -> None:
        if not call.cancelled() and call.exception() is None and isinstance(call.result(), PrefillResult):
            self._background.spawn(self.release(call.result().transfer_params), "release of an abandoned prefill")

    async def release(self, transfer_params: TransferParams) -> None:
        # Any rank's transfer client can release a lease on any prefill engine.
        await self._local.release(transfer_params)

    # -- health, stats ------------------------------------------------------------------------

    async def check_health(self) -> None:
        self._ensure_watchdog()
        if self._broken is None:
            hung = self._stall.verdict(time.monotonic()) or await self._unresponsive_rank()
            if hung:
                self._mark_broken(hung)
        if self._broken:
            raise GroupBroken(self._broken)
        await self._local.check_health()

    async def _unresponsive_rank(self) -> str | None:
        """A remote rank that does not answer its health check within RANK_HEALTH_TIMEOUT_S."""
        checks = [asyncio.ensure_future(rank.check_health()) for rank in self._ranks[1:]]
        try:
            for index, check in enumerate(checks, start=1):
                if not await result_within(check, RANK_HEALTH_TIMEOUT_S):
                    return f"rank {index} did not answer its health check within {RANK_HEALTH_TIMEOUT_S:g}s"
                if check.exception() is not None:
                    return f"rank {index} failed its health check: {type(check.exception()).__name__}: " \
                           f"{str(check.exception())[:200]}"
            return None
        finally:
            for check in checks:
                check.cancel()

    async def stats(self) -> ServerStats:
        """The ranks' stats summed (`group_stats`). Expert load is best-effort per rank: a rank
        that cannot report it counts as an empty mapping, and the KV and request counters stay."""
        per_rank = [await rank.stats() for rank in self._ranks]
        loads = [await self._observed.get(f"rank {index}", "routed_tokens_per_expert",
                                          rank.routed_tokens_per_expert, {})
                 for index, rank in enumerate(self._ranks)]
        for stats, load in zip(per_rank, loads):
            stats.routed_tokens_per_expert = load
        self._export_expert_load(loads)
        return group_stats(per_rank, merge_expert_load(loads))

    async def record_routing_stats(self) -> dict:
        """Serve asks every `routing.stats_period_s` (pools with our request router): the ranks'
        reports merged (`merge_routing_stats`), and each rank's resident prefix blocks kept for
        choosing the rank of the next requests (`pick_rank`)."""
        reports = await asyncio.gather(*(self._rank_report(rank) for rank in self._ranks))
        self._rank_caches = [frozenset(report.get("resident", ())) if report else frozenset() for report in reports]
        sizes = {report["block_size"] for report in reports if report and report.get("block_size")}
        self._cache_block_size = sizes.pop() if len(sizes) == 1 else None
        return merge_routing_stats(reports)

    async def _rank_report(self, rank) -> dict | None:
        call = asyncio.ensure_future(rank.record_routing_stats())
        if not await result_within(call, RANK_REPORT_TIMEOUT_S):
            call.cancel()  # a busy rank answers next period; the router treats old reports as stale
            return None
        return call.result() if call.exception() is None else None

    async def placement(self) -> list[dict]:
        """Per rank (index = rank): its process, node and the experts its engine holds. A rank
        that cannot answer at all is reported with every field empty."""
        return list(await asyncio.gather(*(
            self._observed.get(f"rank {index}", "placement", rank.placement, unknown_placement())
            for index, rank in enumerate(self._ranks))))

    # -- internals ----------------------------------------------------------------------------

    def _route(self, request: EngineRequest) -> int:
        from monitoring import metrics as m

        hits = None
        if self._cache_block_size and any(self._rank_caches):
            hashes = prompt_block_hashes(request.prompt_token_ids, self._cache_block_size)
            hits = [leading_hits(hashes, cache) for cache in self._rank_caches]
        rank = pick_rank(self._in_flight, hits)
        self._in_flight[rank] += 1
        self._exporter.inc(m.ROUTED_REQUESTS, pool=self._pool, rank=str(rank))
        return rank

    def _failure(self) -> EngineFailure:
        return EngineFailure(f"expert-parallel engine group unavailable ({self._broken}); "
                             "it is being restarted, retry the request", retriable=True)

    def _mark_broken(self, reason: str) -> None:
        if self._broken is None:
            from monitoring import metrics as m

            logger.error("engine group broken: %s; failing its requests, Serve will replace it", reason)
            self._broken = reason
            self._broken_event.set()
            self._exporter.inc(m.GROUP_FAILURES, pool=self._pool)
            # The surviving ranks cannot serve without the dead one; stop their engines now
            # (their workers may wait in a collective forever and outlive a plain kill).
            self._background.spawn(self._stop_surviving_ranks(), "stopping the surviving ranks")

    async def _stop_surviving_ranks(self) -> None:
        for rank in self._ranks[1:]:
            rank.shutdown_engine()
        await asyncio.to_thread(self._local.shutdown_engine)

    def _ensure_watchdog(self) -> None:
        """Started lazily: the constructor may run outside the replica's event loop."""
        if self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._watch())
            self._export_task = asyncio.ensure_future(self._export_periodically())

    async def _export_periodically(self, period_s: float = 5.0) -> None:
        while not self._broken:
            await asyncio.sleep(period_s)
            try:
                await self.stats()
            except Exception as exc:  # a dying rank: the watchdog reports it
                logger.debug("expert load export skipped: %s", exc)

    async def _watch(self) -> None:
        """Learn of a rank's death at once: each remote rank holds one never-ending call."""
        if not self._remote:
            return
        waits = {asyncio.ensure_future(rank.wait_forever()): index + 1 for index, rank in enumerate(self._ranks[1:])}
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            exc = task.exception()
            self._mark_broken(f"rank {waits[task]} died ({type(exc).__name__ if exc else 'exited'})")

    def _export_expert_load(self, loads: list[dict[int, int]]) -> None:
        """Per-rank, per-expert routed tokens as a Prometheus counter (through Ray's metrics)."""
        from monitoring import metrics as m

        for rank, load in enumerate(loads):
            for expert, tokens in load.items():
                self._expert_mirror.update(m.EXPERT_TOKENS, tokens, pool=self._pool, rank=str(rank), expert=str(expert))

    def __del__(self):
        for actor in getattr(self, "_remote", []):
            try:
                import ray

                if ray.is_initialized():  # never start Ray just to clean up
                    ray.kill(actor)
            except Exception:  # interpreter or Ray shutting down: the owner's death kills them anyway
                pass


def unknown_placement() -> dict:
    """LLMServer.placement's fields, all empty."""
    return {"process_id": None, "node_id": None, "layers": [], "parameter_bytes": {}}
