"""How the ingress reaches an engine pool: a Serve deployment handle, seen as a plain stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from deployments.records import EngineFailure, EngineRequest, TokenDelta


class HandleEngineClient:
    """Streams from an engine-server deployment; cancelling the stream cancels the remote call
    (and so aborts the request inside the engine)."""

    def __init__(self, handle: Any):
        self._handle = handle

    async def stream(self, request: EngineRequest, **_options: Any) -> AsyncIterator[TokenDelta | EngineFailure]:
        response = self._handle.options(stream=True).generate.remote(request)
        done = False
        try:
            async for item in response:
                yield item
            done = True
        except Exception as exc:  # replica died, unreachable or unhealthy: the client may retry
            done = True
            yield EngineFailure(f"engine replica failed: {type(exc).__name__}: {str(exc)[:300]}", retriable=True)
        finally:
            if not done:
                response.cancel()

    async def health(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._handle.check_health.remote(), timeout_s)


def as_engine_client(engine: Any) -> Any:
    """Wrap a Serve handle; anything else (a test's fake) must already have stream()/health()."""
    from ray.serve.handle import DeploymentHandle

    return HandleEngineClient(engine) if isinstance(engine, DeploymentHandle) else engine
