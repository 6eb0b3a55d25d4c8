"""An engine server replica: one vLLM engine, streaming deltas, aborting what clients drop.

A plain class; deployments/builder.py turns it into a Serve deployment. Tests may construct
it with any engine that has VLLMEngine's interface.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from deployments.records import EngineFailure, EngineRequest, ServerStats, TokenDelta
from deployments.stream_coalescer import coalesce

logger = logging.getLogger(__name__)


class LLMServer:
    def __init__(self, model: dict, engine: dict, model_path: str, engine_factory: Callable[..., Any] | None = None):
        if engine_factory is None:
            from deployments.vllm_engine import VLLMEngine

            engine_factory = VLLMEngine.start
        self._engine = engine_factory(model, engine, model_path)
        self._stats = ServerStats(replica_id=f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:6]}")
        self._in_flight: set[str] = set()
        self._stream_interval_s = engine.get("stream_interval_ms", 0) / 1000.0

    async def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta | EngineFailure]:
        """Stream deltas; if the caller goes away (cancel/close) the engine request is aborted."""
        self._stats.started_total += 1
        self._in_flight.add(request.request_id)
        finished = False
        try:
            deltas = coalesce(self._engine.generate(request), self._stream_interval_s,
                              merge=TokenDelta.then, is_final=lambda d: d.finish_reason is not None)
            async for delta in deltas:
                finished = delta.finish_reason is not None
                yield delta
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:  # engine errors become values so the ingress can answer cleanly
            logger.exception("request %s failed in the engine", request.request_id)
            self._stats.failed_total += 1
            finished = True
            yield EngineFailure(message=f"engine error: {type(exc).__name__}: {exc}", retriable=True)
        finally:
            self._in_flight.discard(request.request_id)
            if finished:
                self._stats.finished_total += 1
            else:
                # The consumer stopped early (client disconnect): stop the work in the engine.
                self._stats.aborted_total += 1
                await asyncio.shield(self._engine.abort(request.request_id))

    async def stats(self) -> ServerStats:
        self._stats.in_flight_request_ids = sorted(self._in_flight)
        self._stats.engine_unfinished_requests = self._engine.unfinished_requests()
        return self._stats

    async def check_health(self) -> None:
        """Called by Serve periodically; raising marks the replica unhealthy and restarts it."""
        await self._engine.check_health()

    def __del__(self):
        engine = getattr(self, "_engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:  # interpreter shutdown: nothing useful left to do
                pass
