"""The two sides of the request path's engine boundary, as Protocols, and the handle client.

EngineServer: what one replica of an engine pool is, whatever it holds: LLMServer (one vLLM
engine) or ExpertParallelGroup (N ranks). EngineClient: what the ingress streams from, whatever
stands behind it: a pool's Serve handle (HandleEngineClient), the disaggregated prefill-then-
decode client (DisaggregatedEngineClient), or a test's fake. tests/unit/deployments/test_engine_protocols.py
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
        assignment = _assignment(response)
        done = False
        try:
            if assignment is not None:
                await asyncio.shield(assignment)  # see cancel_call: never cancel the router mid-assignment
            async for item in response:
                yield item
            done = True
        except Exception as exc:  # replica died, unreachable or unhealthy: the client may retry
            done = True
            yield EngineFailure(f"engine replica failed: {type(exc).__name__}: {str(exc)[:300]}", retriable=True)
        finally:
            if not done:
                cancel_call(response, assignment)

    async def health(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._handle.check_health.remote(), timeout_s)


ASSIGNMENT_GRACE_S = 5.0


def _assignment(response: Any) -> asyncio.Future | None:
    """The Serve call's replica assignment as a task of its own (None for a test's fake)."""
    fetch = getattr(response, "_fetch_future_result_async", None)  # Serve internals: see cancel_call
    return asyncio.ensure_future(fetch()) if fetch is not None else None


def cancel_call(response: Any, assignment: asyncio.Future | None = None) -> None:
    """Cancel a Serve handle call, also one whose replica was being assigned when it was cancelled.

    `DeploymentResponseGenerator.cancel()` stops the replica's work only once the response has
    fetched its replica result, and the router's assignment is a task the caller awaits: a
    caller cancelled while its request was being sent to a replica cancelled that task with it
    (asyncio cancels the future a task waits on), so the request could run on the replica with
    nothing left to stop it. The caller therefore awaits the assignment through a shield
    (`_assignment`), and a cancelled call is cancelled once its assignment is done, when
    cancel() reaches the replica. One still unassigned ASSIGNMENT_GRACE_S later (queued behind
    busy replicas) is cancelled in the router, where nothing runs yet."""
    if assignment is None or assignment.done():
        response.cancel()
        return

    def when_assigned(task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            response.cancel()

    assignment.add_done_callback(when_assigned)
    asyncio.get_running_loop().call_later(
        ASSIGNMENT_GRACE_S, lambda: None if assignment.done() else response.cancel())


def as_engine_client(engine: Any) -> EngineClient:
    """Wrap a Serve handle; anything else (a test's fake) must already have stream()/health()."""
    from ray.serve.handle import DeploymentHandle

    return HandleEngineClient(engine) if isinstance(engine, DeploymentHandle) else engine
