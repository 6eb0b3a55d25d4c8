"""Scheduler side of our connector (runs in the vLLM engine-core process).

Prefill role: when a request that asked to produce KV finishes normally, hold its blocks
(delayed free) and return TransferParams naming them; the worker holds them under a lease.
Decode role: a request that carries TransferParams reports its prompt as loadable
asynchronously; once vLLM allocated local blocks, the worker pulls the remote blocks into
them. Pull exactly the blocks decode does not already have (a local prefix-cache hit covers
the leading blocks, so only the tail of the remote list is pulled).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kv_transfer.params import CONSUME_KEY, PRODUCE_KEY, TransferParams
from kv_transfer.settings import ConnectorSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullJob:
    """Decode worker: copy remote blocks into local blocks (same order), then release."""

    request_id: str
    params: TransferParams
    local_block_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]


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


class SchedulerSide:
    """`release_now`: frees a prefill's lease without waiting for an engine step (see finished)."""

    def __init__(self, settings: ConnectorSettings, block_size_tokens: int,
                 release_now: Callable[[TransferParams], None] | None = None):
        self._settings = settings
        self._block_size = block_size_tokens
        self._plan = StepPlan()
        self._release_now = release_now

    # -- decode role --------------------------------------------------------------------------

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get(CONSUME_KEY):
            return 0, False
        remote_tokens = min(int(params["remote_num_tokens"]), len(request.prompt_token_ids or ()))
        count = remote_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, local_unhashed_block_ids: list[int], num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get(CONSUME_KEY):
            return
        transfer = TransferParams.from_engine(params)
        params[CONSUME_KEY] = False  # one pull per request, even if vLLM asks again
        if num_external_tokens <= 0 or not local_unhashed_block_ids:
            self._plan.releases.append(transfer)  # everything was a local cache hit
            return
        remote = transfer.remote_block_ids[-len(local_unhashed_block_ids):]
        local = tuple(local_unhashed_block_ids[: len(remote)])
        self._plan.pulls.append(PullJob(request.request_id, transfer, local, tuple(remote)))

    # -- prefill role -------------------------------------------------------------------------

    def finished(self, request: Any, block_ids: list[int], normally: bool) -> tuple[bool, dict | None]:
        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get(CONSUME_KEY):
            # Decode side, aborted before blocks were allocated: the prefill still holds a lease.
            # Not via the step plan: an engine with no other request runs no further step, and
            # the release would wait in the plan until the next request arrives (seen in CI).
            params[CONSUME_KEY] = False
            transfer = TransferParams.from_engine(params)
            if self._release_now is not None:
                self._release_now(transfer)
            else:
                self._plan.releases.append(transfer)
            return False, None
        if not params.get(PRODUCE_KEY) or not normally or not block_ids:
            return False, None
        lease_s = float(params.get("lease_s", self._settings.lease_s))
        self._plan.grants.append(LeaseGrant(request.request_id, tuple(block_ids), lease_s))
        transfer = TransferParams(
            remote_host=self._settings.host, remote_port=self._settings.port,
            remote_engine_id=self._settings.engine_id, remote_request_id=request.request_id,
            remote_block_ids=tuple(block_ids), remote_num_tokens=request.num_computed_tokens,
            block_size_tokens=self._block_size, lease_deadline_unix_s=time.time() + lease_s,
        )
        return True, transfer.to_engine()

    # -- every step ---------------------------------------------------------------------------

    def take_plan(self) -> StepPlan:
        plan, self._plan = self._plan, StepPlan()
        return plan
