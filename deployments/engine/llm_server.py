"""An engine server replica: one vLLM engine, streaming deltas, aborting what clients drop.

A plain class; deployments/builder.py turns it into a Serve deployment. Tests may construct
it with any engine that has VLLMEngine's interface.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from deployments.background import Background
from deployments.records import EngineFailure, EngineRequest, PrefillResult, SamplingSpec, ServerStats, TokenDelta
from deployments.engine.aborted_ids import AbortedIds
from deployments.engine.observed_fields import ObservedFields
from deployments.engine.stream_coalescer import coalesce
from deployments.ports import reserve_port
from deployments.stream_deadlines import RequestTimeouts, result_within, wait_expired
from kv_transfer.params import TransferParams

logger = logging.getLogger(__name__)

# Most recent prefix-cache blocks a replica reports to routers (8 bytes each, every stats period).
ROUTING_REPORT_BLOCKS = 16_384
# After aborting a prefill past its bound: how long the engine gets to end the request's stream
# (with its abort, or with the lease of a prompt that finished first) before it is given up.
ABORT_GRACE_S = 5.0


class LLMServer:
    """`kv_transfer` (disaggregated pools, or any pool with a KV pool): the manifest's kv_transfer
    section as a dict (plus "pool" settings); the replica completes it with the address its
    engine's connector serves blocks (and its counters) on."""

    def __init__(self, model: dict, engine: dict, model_path: str, kv_transfer: dict | None = None,
                 engine_factory: Callable[..., Any] | None = None, pool: str = "engine", rank: int = 0,
                 metrics: bool = True, metrics_backend: Any = None, kv_events: bool = False,
                 request_timeouts: dict | None = None):
        """`pool`, `rank`: metric labels; `metrics`: export Prometheus metrics (ours and vLLM's);
        `kv_events`: follow the engine's KV cache events and report its prefix cache to routers;
        `request_timeouts`: the manifest's effective bounds (this server enforces the prefill's)."""
        from monitoring.engine_metrics import EngineServerMetrics
        from monitoring.exporter import MetricsExporter

        self._metrics = EngineServerMetrics(MetricsExporter(metrics, metrics_backend), pool, rank)
        self._observed = ObservedFields(logger)
        self._source = f"{pool} rank {rank}"
        self._exporting: asyncio.Task | None = None
        if engine_factory is None:
            from deployments.engine.vllm_engine import VLLMEngine

            engine_factory = functools.partial(VLLMEngine.start, ray_metrics=metrics)
        self._stats = ServerStats(replica_id=f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}")
        self._kv = (connector_settings(kv_transfer, self._stats.replica_id, int(engine.get("tensor_parallel_size", 1)))
                    if kv_transfer else None)
        self._kv_client = None
        self._cache_events = None
        factory_options: dict[str, Any] = {}
        if kv_events:
            from deployments.routing.kv_event_subscriber import KVEventSubscriber, events_config, free_port

            ports = free_port(), free_port()
            self._cache_events = KVEventSubscriber(*ports).start()  # binds before the engine connects
            dp_rank = int((engine.get("extra_args") or {}).get("data_parallel_rank", 0))
            factory_options["kv_events"] = events_config(*ports, data_parallel_rank=dp_rank)
        if self._kv is not None:
            from kv_transfer.transport import get_backend

            self._kv_client = get_backend(self._kv["backend"]).client_cls()
            self._engine = engine_factory(model, engine, model_path, kv_connector=self._kv, **factory_options)
        else:
            self._engine = engine_factory(model, engine, model_path, **factory_options)
        self._timeouts = RequestTimeouts.of(request_timeouts)
        self._in_flight: set[str] = set()
        # Prompt tokens to prefill per request in the engine, until its first delta (routing report).
        self._prompt_pending: dict[str, int] = {}
        self._aborted = AbortedIds()
        self._background = Background(logger)
        self._stream_interval_s = engine.get("stream_interval_ms", 0) / 1000.0

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta | EngineFailure]:
        """Stream deltas; if the caller goes away (cancel/close) the engine request is aborted."""
        if request.pull is not None:  # decode: the prefill's lease time, as a deadline on this node's clock
            request = replace(request, pull=request.pull.received(time.monotonic()))
        self._ensure_exporting()
        self._stats.started_total += 1
        if self._aborted.contains(request.request_id, time.monotonic()):  # its abort overtook it
            self._stats.aborted_total += 1
            return
        self._in_flight.add(request.request_id)
        if request.pull is None:  # a pulled prompt's KV arrives over the wire; the rest is computed here
            self._prompt_pending[request.request_id] = len(request.prompt_token_ids)
        finished = False
        deltas = None
        try:
            deltas = coalesce(self._engine.generate(request), self._stream_interval_s,
                              merge=TokenDelta.then, is_final=lambda d: d.finish_reason is not None)
            async for delta in deltas:
                self._prompt_pending.pop(request.request_id, None)
                if self._aborted.contains(request.request_id, time.monotonic()):
                    break  # aborted while vLLM was still adding it: the finally ends it now
                finished = delta.finish_reason is not None
                if delta.finish_reason == "error":
                    self._stats.failed_total += 1
                    yield self._ended_in_error(request)
                    break
                yield delta
        except Exception as exc:  # engine errors become values so the ingress can answer cleanly
            self._stats.failed_total += 1
            finished = True
            refusal = invalid_request(exc)
            if refusal is not None:  # vLLM's own validation of the request: the client's to fix
                logger.info("request %s refused by the engine: %s", request.request_id, exc)
                yield refusal
            else:
                logger.exception("request %s failed in the engine", request.request_id)
                yield EngineFailure(message=f"engine error: {type(exc).__name__}: {exc}", retriable=True)
        finally:
            self._in_flight.discard(request.request_id)
            self._prompt_pending.pop(request.request_id, None)
            if finished:
                self._stats.finished_total += 1
            else:
                # The consumer stopped early (client disconnect): stop the work in the engine.
                self._stats.aborted_total += 1
                await asyncio.shield(self._abort(deltas, request.request_id))

    async def abort(self, request_id: str) -> None:
        """End a request by id, also one not yet in the engine (see aborted_ids.py): a rank
        actor's caller sends this after cancelling its stream, because a Ray cancel that arrives
        while the stream is between items, or before it started, never reaches generate()."""
        self._aborted.add(request_id, time.monotonic())
        await self._engine.abort(request_id)

    async def _abort(self, deltas: AsyncIterator | None, request_id: str) -> None:
        """Close the engine's stream (which ends the coalescer's reader task now, not whenever
        the generator is collected), then abort by id."""
        if deltas is not None:
            try:
                await deltas.aclose()
            except Exception:  # the stream's own failure: the abort below is what matters
                logger.debug("closing the engine stream of %s failed", request_id, exc_info=True)
        await self._engine.abort(request_id)

    def _ended_in_error(self, request: EngineRequest) -> EngineFailure:
        """The engine ended the request itself with an error. A KV load that failed under
        failure_policy fail is worth a retry (another prefill, a pool back up); anything else
        (the grammar backend rejecting every allowed token, say) fails the same way again, and
        vLLM's server answers it 500."""
        kv_load = request.pull is not None or (self._kv is not None and self._kv["failure_policy"] == "fail")
        if kv_load:
            return EngineFailure("the engine ended the request with an error (a KV load failed under "
                                 "failure_policy=fail)", retriable=True)
        return EngineFailure("the engine ended the request with an error", retriable=False)

    async def prefill(self, request: EngineRequest) -> PrefillResult | EngineFailure:
        """Run the prompt only (one token) and keep its KV blocks for a decode replica to pull.

        Not abortable on purpose: when a client leaves, Serve cancels this call too, possibly
        just after the engine granted the lease but before the result got back, and nobody
        would know the lease. A cancelled prefill therefore runs to its end (one prompt's
        work, bounded by request_timeouts.prefill_timeout_s) and releases what it got.
        """
        work = asyncio.ensure_future(self._prefill(request))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            work.add_done_callback(self._release_abandoned)
            self._background.spawn(work, f"abandoned prefill {request.request_id}")  # runs on, held
            raise

    def _release_abandoned(self, work: asyncio.Future) -> None:
        if work.cancelled() or work.exception() is not None:
            return
        result = work.result()
        if isinstance(result, PrefillResult):
            self._stats.abandoned_prefills_total += 1
            self._background.spawn(self.release(result.transfer_params), f"release of abandoned prefill {result.transfer_params.remote_request_id}")

    async def _prefill(self, request: EngineRequest) -> PrefillResult | EngineFailure:
        """Bounded by prefill_timeout_s from receipt. Past it the request is aborted in the
        engine but its stream is still read (for ABORT_GRACE_S): it ends with the abort, or with
        the lease of a prompt that finished first, which is then returned rather than lost."""
        from kv_transfer.params import handed_over, is_transfer

        started = time.monotonic()
        # The same salt as decode's request: the blocks hash (and are cached and pooled) alike;
        # the same session: the pool pins what prefill stores of it.
        prefill_request = EngineRequest(request.request_id, request.prompt_token_ids,
                                        SamplingSpec(max_tokens=1, temperature=0.0), produce_kv=True,
                                        cache_salt=request.cache_salt, session_id=request.session_id)
        final = None
        cached_tokens = 0
        limit_s = self._timeouts.for_prompt(len(request.prompt_token_ids)).prefill_timeout_s
        deadline_s, aborted = started + limit_s, False
        stream = self.generate(prefill_request)
        step: asyncio.Future | None = None
        try:
            while True:
                if step is None:
                    step = asyncio.ensure_future(anext(stream))
                if not await result_within(step, deadline_s - time.monotonic()):
                    if aborted:  # the engine did not even end the aborted request: give up on it
                        return wait_expired("prefill", limit_s)
                    aborted = True
                    logger.warning("prefill %s exceeded %gs: aborting it", request.request_id, limit_s)
                    await result_within(asyncio.ensure_future(self._engine.abort(request.request_id)), ABORT_GRACE_S)
                    deadline_s = time.monotonic() + ABORT_GRACE_S
                    continue
                try:
                    item = step.result()
                except StopAsyncIteration:
                    break
                step = None
                if isinstance(item, EngineFailure):
                    return item
                final = item
                cached_tokens = item.cached_tokens if item.cached_tokens is not None else cached_tokens
        finally:
            if step is not None and not step.done():
                step.cancel()  # generate's own clean-up aborts the request (once more)
            else:
                await stream.aclose()
        if final is None or not is_transfer(final.kv_transfer_params):
            if aborted:
                return wait_expired("prefill", limit_s)
            return EngineFailure("prefill finished without KV transfer parameters", retriable=True)
        # Decode goes by the lease time left as the params leave this node, read on the clock that set it.
        return PrefillResult(TransferParams.from_engine(handed_over(final.kv_transfer_params, time.time())),
                             final.prompt_tokens,
                             time.monotonic() - started, final.kv_load.pool_s if final.kv_load else 0.0, cached_tokens,
                             final.kv_load.pool_disk_s if final.kv_load else 0.0)

    async def release(self, transfer_params: TransferParams) -> None:
        """Free a prefill's leased blocks that no decode will pull (e.g. the client went away),
        on every tensor-parallel rank (each holds the lease on its shard)."""
        params = transfer_params
        await asyncio.gather(*(asyncio.to_thread(self._kv_client.release, params.remote_host, port,
                                                 params.remote_request_id, 5.0, tuple(params.remote_block_ids),
                                                 params.grant_bytes())
                               for port in params.rank_ports()))

    async def _kv_stats(self) -> dict:
        """The connector's counters, from every tensor-parallel rank's port (kv_transfer/rank_stats.py)."""
        from kv_transfer.rank_stats import merge_rank_stats

        host, first = self._kv["host"], self._kv["port"]
        ranks = await asyncio.gather(*(asyncio.to_thread(self._kv_client.stats, host, port, 5.0)
                                       for port in range(first, first + self._kv["tp_size"])))
        return merge_rank_stats(ranks)

    async def stats(self) -> ServerStats:
        self._stats.in_flight_request_ids = sorted(self._in_flight)
        self._stats.engine_unfinished_requests = self._engine.unfinished_requests()
        self._stats.process_id = os.getpid()
        if self._kv_client is not None:
            self._stats.kv_transfer = await self._kv_stats()
        return self._stats

    def record_routing_stats(self) -> dict:
        """Serve asks every `routing.stats_period_s`; our request router reads it. The epoch names
        this engine: a new one means an empty prefix cache, whatever was routed here before."""
        stats = {"epoch": self._stats.replica_id, "in_flight": len(self._in_flight), "at_s": time.time(),
                 "prompt_tokens_pending": sum(self._prompt_pending.values())}
        scheduler = getattr(self._engine, "scheduler", None)
        if scheduler is not None:
            stats.update(waiting=scheduler.waiting, kv_usage=scheduler.kv_cache_usage)
        if self._cache_events is not None:
            block_size, resident = self._cache_events.snapshot(ROUTING_REPORT_BLOCKS)
            if block_size is not None:
                stats.update(block_size=block_size, resident=resident)
        return stats

    def _ensure_exporting(self) -> None:
        """Started on first use: the constructor may run outside the replica's event loop."""
        if self._exporting is None and self._metrics.enabled:
            self._exporting = asyncio.ensure_future(self._export_periodically())

    async def _export_periodically(self, period_s: float = 5.0) -> None:
        while True:
            kv = {}
            if self._kv_client is not None:
                # The connector's counters come over its transfer port; when that port cannot
                # answer (starting, or saturated), the engine's own load is exported all the
                # same: the autoscaler and alerts must not lose a replica's queue with it.
                try:
                    kv = await self._kv_stats()
                except Exception as exc:
                    logger.debug("kv transfer stats unavailable this period: %s", exc)
            try:
                self._metrics.export(len(self._in_flight), kv, getattr(self._engine, "scheduler", None))
            except Exception as exc:  # the engine is starting or stopping: try again next period
                logger.debug("metrics export skipped: %s", exc)
            await asyncio.sleep(period_s)

    async def routed_tokens_per_expert(self) -> dict[int, int]:
        """Expert-parallel ranks: tokens routed to the experts this engine holds
        (deployments/engine/expert_observation.py)."""
        from deployments.expert_parallel.expert_ranks import merge_expert_load

        return merge_expert_load(await self._engine.collective_rpc("routed_tokens_per_expert"))

    async def placement(self) -> dict:
        """Where this engine runs and, for expert-parallel ranks, which experts it holds
        (read from the engine's own expert map, per MoE layer). Each field is best-effort: one
        the engine cannot report is empty, the others stay."""
        node_id = None
        try:
            import ray

            if ray.is_initialized():  # outside Ray, the runtime context would start or join a cluster
                node_id = ray.get_runtime_context().get_node_id()
        except Exception:  # Ray missing or shutting down: the node is unknown
            pass
        experts = await self._observed.get(self._source, "local_experts", lambda: self._worker_answer("local_experts"), [])
        weights = await self._observed.get(self._source, "parameter_bytes",
                                           lambda: self._worker_answer("parameter_bytes"), {})
        return {"process_id": os.getpid(), "node_id": node_id, "layers": experts, "parameter_bytes": weights}

    async def _worker_answer(self, method: str) -> Any:
        """The answer of the engine's first worker (an expert-parallel rank's engine has one)."""
        return (await self._engine.collective_rpc(method))[0]

    async def wait_forever(self) -> None:
        """Never returns: the group's watchdog awaits it to learn at once when this rank dies."""
        self._ensure_exporting()  # a rank's first call: from now on its metrics are fresh even when idle
        await asyncio.Event().wait()

    async def check_health(self) -> None:
        """Called by Serve periodically; raising marks the replica unhealthy and restarts it."""
        # Export from the first health check on, not the first request: an idle pool must look
        # idle to the autoscaler, not stale (which makes it hold every pool).
        self._ensure_exporting()
        await self._engine.check_health()

    def shutdown_engine(self) -> None:
        """Stop the engine and its processes now (idempotent). An expert-parallel group calls it
        when a peer rank died: this engine's worker may be stuck in a collective, and Serve's
        kill of the replica alone would leave that process behind."""
        engine, self._engine = getattr(self, "_engine", None), None
        if getattr(self, "_cache_events", None) is not None:
            self._cache_events.stop()
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as exc:  # already gone, or the interpreter is shutting down
                logger.debug("engine shutdown: %s", exc)

    def __del__(self):
        self.shutdown_engine()


def invalid_request(exc: BaseException) -> EngineFailure | None:
    """The failure to answer for an exception vLLM raised while taking a request in, when it is
    vLLM's validation of the request (its own server answers those 400), else None.

    vLLM checks some parameters only when the engine takes the request (logprobs above the
    engine's max_logprobs, logit_bias or allowed_token_ids outside the vocabulary, a prompt
    longer than the model's context): it raises a VLLMClientError before the request reaches
    the engine core. Other exceptions (the engine died, a bug) stay retriable."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # an engine without it (test fakes): nothing is a validation error
        return None
    if isinstance(exc, VLLMClientError):
        return EngineFailure(str(exc), retriable=False, invalid_request=True,
                             param=getattr(exc, "parameter", None))
    return None


def connector_settings(kv_transfer: dict, engine_id: str, tp_size: int = 1) -> dict:
    """The manifest's kv_transfer section plus this replica's serving address (and, with a KV
    pool, the pool's settings with the address this engine's segment is reached at). A
    tensor-parallel engine gets `tp_size` consecutive ports, one per worker rank."""
    host = kv_transfer.get("host") or _node_ip()
    port = reserve_port(host, count=tp_size)  # the engine's workers bind them later (deployments/ports.py)
    settings = {"backend": kv_transfer["backend"], "host": host, "port": port, "tp_size": tp_size,
                "engine_id": engine_id,
                "lease_s": kv_transfer["lease_s"], "transfer_timeout_s": kv_transfer["transfer_timeout_s"],
                "failure_policy": kv_transfer["failure_policy"], "grant_secret": kv_transfer.get("grant_secret", ""),
                "lends_kv": bool(kv_transfer.get("lends_kv", False)),
                "max_connections": int(kv_transfer.get("max_connections", 256)),
                "protocol": kv_transfer.get("protocol", "tcp"), "device_name": kv_transfer.get("device_name", ""),
                "staging_bytes": int(kv_transfer.get("staging_mib", 256)) << 20,
                "min_transfer_bytes_per_s": float(kv_transfer.get("min_transfer_mib_s", 64)) * (1 << 20)}
    if kv_transfer.get("pool"):
        settings["pool"] = {**kv_transfer["pool"], "local_hostname": host}
        if settings["pool"].get("disk_dir"):  # this engine's own folder of the disk tier
            settings["pool"]["disk_dir"] = f"{settings['pool']['disk_dir']}/{engine_id}"
    return settings


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # not inside Ray (tests constructing the server directly)
        return "127.0.0.1"
