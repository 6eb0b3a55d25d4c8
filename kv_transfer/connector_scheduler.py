"""Scheduler side of our connector (runs in the vLLM engine-core process).

Prefill role: when a request that asked to produce KV finishes normally, hold its blocks
(delayed free) and return TransferParams naming them; the worker holds them under a lease.
Decode role: a request that carries TransferParams reports its prompt as loadable
asynchronously; once vLLM allocated local blocks, the worker pulls the remote blocks into
them. Pull exactly the blocks decode does not already have (a local prefix-cache hit covers
the leading blocks, so only the tail of the remote list is pulled).
Every role, with a KV pool (`pool.scheduler_tier`): blocks after the local prefix-cache hit
that the pool holds are read from it (decode: before the rest is pulled from the prefill's
lease), and a normally finished request offers its computed blocks to the pool.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from kv_transfer.params import (CONSUME_KEY, LOAD_TIMING_KEY, PRODUCE_KEY, InvalidTransferParams, LoadTiming,
                                TransferParams)
from kv_transfer.pool.records import LookupTally, PoolBlock, PoolStoreJob
from kv_transfer.settings import ConnectorSettings

logger = logging.getLogger(__name__)

_MAX_PENDING_TIMINGS = 10_000


@dataclass(frozen=True)
class PullJob:
    """Load a request's external blocks: first `pool_blocks` from the pool, then the remote
    blocks into the local blocks (same order) from the prefill's lease, which is then
    released. `params` is None for a pool-only load."""

    request_id: str
    params: TransferParams | None
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    pool_blocks: tuple[PoolBlock, ...] = ()


@dataclass(frozen=True)
class LeaseGrant:
    """Prefill worker: hold these blocks for this request until released or expired."""

    request_id: str
    block_ids: tuple[int, ...]
    lease_s: float


@dataclass
class StepPlan:
    """What the scheduler asks the worker to do this step (shipped as connector metadata)."""

    pulls: list[PullJob] = field(default_factory=list)
    grants: list[LeaseGrant] = field(default_factory=list)
    releases: list[TransferParams] = field(default_factory=list)  # decode never pulled: free prefill
    pool_stores: list[PoolStoreJob] = field(default_factory=list)
    pool_lookups: LookupTally = field(default_factory=LookupTally)


class SchedulerSide:
    """`release_now`: frees a prefill's lease without waiting for an engine step (see finished)."""

    def __init__(self, settings: ConnectorSettings, block_size_tokens: int,
                 release_now: Callable[[TransferParams], None] | None = None, pool: Any = None,
                 block_bytes: int = 0):
        """`pool`: a PoolScheduler when the engine uses a KV pool; `block_bytes`: one block of
        every layer of this engine's cache (a lease lasts longer for more bytes)."""
        self._settings = settings
        self._grant_key = settings.grant_key()  # signs the leases it grants, checks those it pulls (None: neither)
        self._block_size = block_size_tokens
        self._block_bytes = block_bytes
        self._plan = StepPlan()
        self._release_now = release_now
        self._pool = pool
        self._load_times: dict[str, LoadTiming] = {}  # reported by the worker, until the request ends
        self.refused_params_total = 0  # requests whose transfer parameters were refused

    # -- admission: local hit, then pool, then (decode) the prefill's lease ---------------------

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        pool_tokens = self._pool.lookup(request, num_computed_tokens) * self._block_size if self._pool else 0
        transfer = self._pull_params(request)
        if transfer is not None:
            remote_tokens = min(transfer.remote_num_tokens, len(request.prompt_token_ids or ()))
            count = max(remote_tokens, num_computed_tokens + pool_tokens) - num_computed_tokens
        else:
            count = pool_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, local_unhashed_block_ids: list[int], num_external_tokens: int) -> None:
        first_block, pool_hit = self._pool.take_hit(request.request_id) if self._pool else (0, 0)
        local_ids = list(local_unhashed_block_ids) if num_external_tokens > 0 else []
        pool_hit = min(pool_hit, len(local_ids))
        pool_blocks = self._pool.load_blocks(request, first_block, local_ids[:pool_hit]) if pool_hit else ()
        if pool_hit:
            self._pool.loaded(request.request_id, first_block, pool_hit)
        transfer = self._pull_params(request)
        if transfer is None:
            if pool_blocks:
                self._plan.pulls.append(PullJob(request.request_id, None, (), (), pool_blocks))
            return
        request.kv_transfer_params[CONSUME_KEY] = False  # one pull per request, even if vLLM asks again
        if not local_ids:
            self._plan.releases.append(transfer)  # everything was a local cache hit
            return
        # The remote list covers the prompt from block 0; the local blocks cover its tail after
        # the local hit: the pool's part first, then what only the lease holds.
        remote = transfer.remote_block_ids[-len(local_ids):]
        local = tuple(local_ids[pool_hit:len(remote)])
        remote = tuple(remote[pool_hit:pool_hit + len(local)])
        if not local and not pool_blocks:
            self._plan.releases.append(transfer)
            return
        self._plan.pulls.append(PullJob(request.request_id, transfer, local, remote, pool_blocks))

    # -- prefill role -------------------------------------------------------------------------

    def finished(self, request: Any, block_ids: list[int], normally: bool) -> tuple[bool, dict | None]:
        delay, out = self._finished_transfer(request, block_ids, normally)
        store = None
        if self._pool is not None:
            # Not `delay` alone: a lease already holds the blocks; the store then only has to
            # finish before the worker reports them free (it waits for both).
            store = self._pool.store_job(request, block_ids, holds_blocks=not delay) if normally else None
            self._pool.forget(request.request_id)
        if store is not None:
            self._plan.pool_stores.append(store)
            delay = True
        # What the request's loads cost goes back with its output (the ingress's pool_load and
        # kv_transfer phases); a prefill's transfer parameters carry it to the decode side too.
        timing = self._load_times.pop(request.request_id, None)
        if timing is not None:
            out = {**(out or {}), LOAD_TIMING_KEY: timing.to_engine()}
        return delay, out

    def record_load_times(self, times: dict[str, LoadTiming]) -> None:
        for request_id, timing in times.items():
            if timing.pool_failed and self._pool is not None:
                self._pool.load_failed(request_id)
            known = self._load_times.get(request_id)
            self._load_times[request_id] = timing if known is None else known.slower(timing)
        # A load that ends after its request was aborted is never collected by `finished`.
        while len(self._load_times) > _MAX_PENDING_TIMINGS:
            self._load_times.pop(next(iter(self._load_times)))

    def _finished_transfer(self, request: Any, block_ids: list[int], normally: bool) -> tuple[bool, dict | None]:
        transfer = self._pull_params(request)
        if transfer is not None:
            # Decode side, aborted before blocks were allocated: the prefill still holds a lease.
            # Not via the step plan: an engine with no other request runs no further step, and
            # the release would wait in the plan until the next request arrives (seen in CI).
            request.kv_transfer_params[CONSUME_KEY] = False
            if self._release_now is not None:
                self._release_now(transfer)
            else:
                self._plan.releases.append(transfer)
            return False, None
        if not self._lends(request) or not normally or not block_ids:
            return False, None
        # The lease length is the engine's own setting, never the request's: a request must
        # not pin blocks for as long as it likes. It grows with the blocks' bytes, which decode
        # must have time to pull before it ends.
        lease_s = self._settings.lease_for_s(len(block_ids) * self._block_bytes)
        self._plan.grants.append(LeaseGrant(request.request_id, tuple(block_ids), lease_s))
        deadline_s = time.time() + lease_s
        transfer = TransferParams(
            remote_host=self._settings.host, remote_port=self._settings.port,
            remote_engine_id=self._settings.engine_id, remote_request_id=request.request_id,
            remote_block_ids=tuple(block_ids), remote_num_tokens=request.num_computed_tokens,
            block_size_tokens=self._block_size, lease_deadline_unix_s=deadline_s,
            lease_remaining_s=lease_s,  # what decode goes by: a duration, valid on any clock
            remote_tp_size=self._settings.tp_size,  # each worker rank serves its shard on port + rank
        )
        grant = self._grant_key.payload(transfer.grant_scope(), int(deadline_s * 1000))
        return True, replace(transfer, grant=grant.hex()).to_engine()

    # -- what a request's kv_transfer_params may ask -------------------------------------------

    def _lends(self, request: Any) -> bool:
        """Prefill: whether to keep this finished request's blocks for a decode to pull. Only
        an engine that lends KV (and can sign grants) does, whatever a request asks."""
        params = request.kv_transfer_params
        return (self._settings.lends_kv and self._grant_key is not None and isinstance(params, dict)
                and params.get(PRODUCE_KEY) is True)

    def _pull_params(self, request: Any) -> TransferParams | None:
        """Decode: the prefill's lease to pull this request's KV from, or None. Parameters that
        do not parse, or whose grant no engine of this application signed, are refused here,
        on vLLM's scheduler thread, without raising (an exception here kills the engine core)
        and without touching the network: the request is then computed on this engine."""
        params = request.kv_transfer_params
        if not isinstance(params, dict) or params.get(CONSUME_KEY) is not True:
            return None
        refused = None
        try:
            transfer = TransferParams.from_engine(params)
        except InvalidTransferParams as exc:
            refused = str(exc)
        else:
            if self._grant_key is None:
                refused = "this engine has no grant secret, so it pulls no KV"
            elif transfer.remote_tp_size != self._settings.tp_size:
                refused = (f"the prefill engine has {transfer.remote_tp_size} tensor-parallel ranks and this "
                           f"one {self._settings.tp_size}, so no rank holds the heads another pulls")
            else:
                refused = self._grant_key.check(transfer.grant_scope(), transfer.grant_bytes(), now_ms=None)
        if refused is None:
            return transfer
        params[CONSUME_KEY] = False  # decided once per request
        self.refused_params_total += 1
        logger.warning("kv transfer: request %s carries transfer parameters this engine refuses (%s); "
                       "computing its prompt here", request.request_id, refused)
        return None

    # -- every step ---------------------------------------------------------------------------

    def take_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        if self._pool is not None:
            plan.pool_lookups = self._pool.take_tally()
        return plan
