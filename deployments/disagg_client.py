"""The disaggregated request path, seen by the ingress as one stream.

prefill replica: run the prompt, keep the KV blocks, return TransferParams
decode replica:  admit the request with them, pull the blocks, decode, stream tokens

Each pool's router picks its replica when the call is made (after the prefill, for decode).
With `local_hit_fraction` (manifest kv_transfer.local_prefill_hit_fraction) decode is chosen
first instead, by its pool's router in this process: when that replica's prefix cache holds at
least that fraction of the prompt, it prefills the rest itself and no prefill replica is asked
(deployments/routing/pairing.py, rule 2); either way the decode call goes to the replica chosen.

Who frees the prefill's blocks: from the moment the prefill is asked for, this client owns its
lease until decode admits the request. If the caller goes away during the prefill, the prefill
is *not* cancelled: cancelling a Serve call is best effort, and a prefill that completes while
its result is being dropped leaves a lease nobody knows about (seen in CI). Instead the prefill
finishes in the background (at most one prompt's worth of wasted work) and its lease is released
at once. The lease deadline remains the backstop if even the release fails.

The wait for the prefill is bounded (manifest request_timeouts.prefill_timeout_s). Past it the
request ends with a WaitExpired value and the prefill is treated like one whose caller left
(its lease, if it ever gets one, is released); the prefill replica aborts the prompt in its
engine at its own bound (LLMServer.prefill).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from deployments.engine_client import HandleEngineClient
from deployments.records import EngineFailure, EngineRequest, PrefillResult, TokenDelta
from deployments.routing.pairing import DisaggregationRule, local_prefill_reason
from deployments.stream_deadlines import RequestTimeouts, result_within, wait_expired
from kv_transfer.params import TransferParams

logger = logging.getLogger(__name__)


class DisaggregatedEngineClient:
    def __init__(self, prefill_handle: Any, decode_handle: Any, *, allow_fault_injection: bool = False,
                 local_prefill_below_tokens: int = 0, on_decision: Any = None,
                 timeouts: RequestTimeouts | None = None,
                 local_hit_fraction: float | None = None, decode_router: Any = None, prefill_router: Any = None):
        """`on_decision(reason)`: told for each request whether its prefill ran remotely ("remote")
        or on decode ("local_short_prompt", "decode_holds_prefix", "prefill_unavailable");
        `prefill_router()`: the prefill pool's router in this process (its `curr_replicas`), or
        None while it has none; `timeouts`: the request's
        bounds (the prefill's result is awaited for `prefill_timeout_s` grown by the prompt's
        length); `decode_router()`: the decode pool's router in this process (with
        `decide(prompt_token_ids, session_id)` and `block_size`), or None while it has none."""
        self._prefill = prefill_handle
        self._decode = HandleEngineClient(decode_handle)
        self._allow_fault_injection = allow_fault_injection
        self._local_below = local_prefill_below_tokens
        self._on_decision = on_decision or (lambda reason: None)
        self._timeouts = timeouts or RequestTimeouts.of(None)
        self._rule = None if local_hit_fraction is None else \
            DisaggregationRule(min_uncached_tokens=0, local_hit_fraction=local_hit_fraction)
        self._decode_router = decode_router or (lambda: None)
        self._prefill_router = prefill_router or (lambda: None)
        self._background: set[asyncio.Future] = set()

    async def stream(self, request: EngineRequest, *, inject_transfer_failure: bool = False,
                     trace: Any = None) -> AsyncIterator[TokenDelta | EngineFailure]:
        """`trace`: the ingress's monitoring.request_metrics.RequestTrace, told when prefill is done."""
        if len(request.prompt_token_ids) < self._local_below:
            self._on_decision("local_short_prompt")
            async for item in self._decode.stream(request):
                yield item
            return
        request, local_reason = self._route_decode_first(request)
        if local_reason is not None:
            self._on_decision(local_reason)
            async for item in self._decode.stream(request):
                yield item
            return
        if self._prefill_pool_empty():
            # No prefill replica is running (one died, and Serve is starting its replacement): a
            # call now would wait in the handle's queue for the new replica, up to the prefill
            # bound (CI: 125 s, then 504). Decode computes the prompt itself instead, as it does
            # for short prompts: the same output, served now.
            self._on_decision("prefill_unavailable")
            async for item in self._decode.stream(request):
                yield item
            return
        self._on_decision("remote")
        prefill_task = asyncio.ensure_future(self._prefill.prefill.remote(request))
        try:
            prefill_timeout_s = self._timeouts.for_prompt(len(request.prompt_token_ids)).prefill_timeout_s
            if not await result_within(prefill_task, prefill_timeout_s):
                prefill_task.add_done_callback(self._release_when_done)
                self._spawn(prefill_task)  # held until it ends: nothing else refers to it now
                yield wait_expired("prefill", prefill_timeout_s)
                return
            prefill = prefill_task.result()
        except asyncio.CancelledError:
            prefill_task.add_done_callback(self._release_when_done)
            self._spawn(prefill_task)  # held until it ends: nothing else refers to it now
            raise
        except Exception as exc:  # replica died or unreachable
            yield EngineFailure(f"prefill replica failed: {type(exc).__name__}: {str(exc)[:300]}", retriable=True)
            return
        if isinstance(prefill, EngineFailure):
            yield prefill
            return
        if trace is not None:
            trace.mark_prefill_done(pool_load_s=getattr(prefill, "pool_load_s", 0.0),
                                    pool_disk_load_s=getattr(prefill, "pool_disk_load_s", 0.0))
        assert isinstance(prefill, PrefillResult)
        params = prefill.transfer_params
        if inject_transfer_failure and self._allow_fault_injection:
            params = params.with_failure_injected()
        admitted = finished = pull_failed = False
        try:
            async for item in self._decode.stream(replace(request, pull=params)):
                if not admitted and isinstance(item, TokenDelta):
                    # Decode loaded the whole prompt; what the request did not compute is what
                    # the prefill did not compute.
                    item = replace(item, cached_tokens=getattr(prefill, "cached_tokens", 0))
                    admitted = True
                finished = isinstance(item, TokenDelta) and item.finish_reason is not None
                pull_failed = finished and item.kv_load is not None and item.kv_load.pull_failed
                yield item
        finally:
            if not finished or pull_failed:
                # Decode did not finish the request: it failed or refused it, a bound expired, or
                # the caller left. It may never have pulled, or it pulled and died before its own
                # release got out (measured: 8 leases left to expire when a decode rank was
                # killed under load). Or decode finished by recomputing after its pull failed:
                # whatever broke the pull may have lost decode's release as well (CI: a pull and
                # its release failing together, the lease left to expire). Releasing twice is
                # harmless (the prefill side ignores ended leases); leaking blocks is not.
                self._spawn(self._release(params))

    def _prefill_pool_empty(self) -> bool:
        """The prefill pool's router in this process knows of no running replica. (Before its
        first call there is no router: the pool is assumed up.)"""
        router = self._prefill_router()
        return router is not None and not router.curr_replicas

    def _route_decode_first(self, request: EngineRequest) -> tuple[EngineRequest, str | None]:
        """(the request routed to its decode replica, why decode prefills it itself or None)."""
        router = self._decode_router() if self._rule is not None else None
        if router is None:
            return request, None
        decision = router.decide(request.prompt_token_ids, request.session_id)
        if decision is None:
            return request, None
        reason = local_prefill_reason(decision, len(request.prompt_token_ids), router.block_size, 0, self._rule)
        return replace(request, route_to=decision.replica_id), reason

    def _release_when_done(self, prefill_task: asyncio.Future) -> None:
        """The caller left during its prefill: free the blocks the prefill ends up holding."""
        if prefill_task.cancelled() or prefill_task.exception() is not None:
            return  # no result, no lease (a replica that died took its blocks with it)
        result = prefill_task.result()
        if isinstance(result, PrefillResult):
            self._spawn(self._release(result.transfer_params))

    def _spawn(self, work) -> None:
        """Run `work` (or keep a running task) in the background, holding a reference until it
        ends (the event loop keeps only weak ones, so an unreferenced task could be collected
        mid-flight, and with it the release its end would send)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, params: TransferParams) -> None:
        try:
            await self._prefill.release.remote(params)
        except Exception as exc:
            logger.warning("could not release prefill lease %s: %s", params.remote_request_id, exc)

    async def health(self, timeout_s: float) -> None:
        await asyncio.wait_for(self._prefill.check_health.remote(), timeout_s)
        await self._decode.health(timeout_s)
