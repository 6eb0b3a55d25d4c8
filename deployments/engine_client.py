"""The two sides of the request path's engine boundary, as Protocols, and the handle client.

EngineServer: what one replica of an engine pool is, whatever it holds: LLMServer (one vLLM
engine) or ExpertParallelGroup (N ranks). EngineClient: what the ingress streams from, whatever
stands behind it: a pool's Serve handle (HandleEngineClient), the disaggregated prefill-then-
decode client (DisaggregatedEngineClient), or a test's fake. tests/unit/test_engine_protocols.py
checks every implementation against them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from deployments.records import EngineFailure, EngineRequest, PrefillResult, ServerStats, TokenDelta
from kv_transfer.params import TransferParams


class EngineServer(Protocol):
    """One replica of an engine pool (called through Serve handles)."""

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta | EngineFailure]:
        """Stream the request's tokens; a failure is the last item, never an exception. Closing
        the stream aborts the request in the engine."""
        ...

    async def prefill(self, request: EngineRequest) -> PrefillResult | EngineFailure:
        """Run the prompt only and keep its KV blocks under a lease for a decode pull."""
        ...

    async def release(self, transfer_params: TransferParams) -> None:
        """Free a lease no decode will pull."""
        ...

    async def check_health(self) -> None:
        """Raise when the replica cannot serve (Serve then replaces it)."""
        ...

    async def stats(self) -> ServerStats: ...


class EngineClient(Protocol):
    """Where the ingress sends a request's sequences."""

    def stream(self, request: EngineRequest, **options: Any) -> AsyncIterator[TokenDelta | EngineFailure]:
        """Stream the request's tokens; a failure is the last item. Closing it cancels the request."""
        ...

    async def health(self, timeout_s: float) -> None: ...


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
                cancel_call(response)

    async def health(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._handle.check_health.remote(), timeout_s)


_CANCELLING: set[asyncio.Task] = set()  # references to the follow-ups below until they end


def cancel_call(response: Any) -> None:
    """Cancel a Serve handle call, also one whose replica was assigned just as it was cancelled.

    `DeploymentResponseGenerator.cancel()` cancels the replica's work only once the response
    has fetched its replica result. With the router on the caller's loop (as under
    RAY_SERVE_THROUGHPUT_OPTIMIZED, the default manifest's HTTP mode), a caller cancelled
    after the assignment completed but before its await resumed never fetches it: cancel()
    finds nothing to cancel and the request runs on its replica, unread, to max_tokens (seen
    as a decode engine still busy 20 s after its client left). So the cancel is followed by
    fetching the assignment (done, or cancelled by cancel() itself) and cancelling that."""
    response.cancel()
    fetch = getattr(response, "_fetch_future_result_async", None)  # Serve internals: see above
    if fetch is None:
        return

    async def cancel_assigned() -> None:
        try:
            replica_result = await fetch()
        except BaseException:  # noqa: BLE001 - never assigned (cancelled first) or failed: nothing runs
            return
        replica_result.cancel()

    task = asyncio.ensure_future(cancel_assigned())
    _CANCELLING.add(task)
    task.add_done_callback(_CANCELLING.discard)


def as_engine_client(engine: Any) -> EngineClient:
    """Wrap a Serve handle; anything else (a test's fake) must already have stream()/health()."""
    from ray.serve.handle import DeploymentHandle

    return HandleEngineClient(engine) if isinstance(engine, DeploymentHandle) else engine
