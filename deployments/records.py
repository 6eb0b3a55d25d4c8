"""Typed records handed between the ingress and the engine servers.

They cross Ray process boundaries (pickled), so they hold plain data only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kv_transfer.params import LoadTiming, TransferParams


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling settings of one request, engine-agnostic (the engine adapter maps them)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0


@dataclass(frozen=True)
class EngineRequest:
    """A tokenized, validated request for one engine replica."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Any  # vllm.SamplingParams from the ingress's render (n == 1), or a SamplingSpec
    pull: TransferParams | None = None  # decode: the prefill's leased blocks to pull before decoding
    session_id: str | None = None  # the client's conversation, for session-affine routing
    # The replica the pool's router already chose for this request (a Serve replica id): decode
    # is chosen before the prefill runs, so the choice is made once and carried to the call.
    route_to: str | None = None
    produce_kv: bool = False  # prefill: compute the prompt and keep its KV blocks under a lease
    cache_salt: str | None = None  # the client's cache_salt: isolates its prefix-cache and pool blocks


@dataclass(frozen=True)
class TokenDelta:
    """New output of one request since the previous delta."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running
    prompt_tokens: int
    completion_tokens: int  # cumulative
    kv_transfer_params: dict[str, Any] | None = None  # prefill: set on the final delta (TransferParams)
    engine_timing: "EngineTiming | None" = None  # on the first delta (when the engine logs stats)
    kv_load: LoadTiming | None = None  # on the final delta, when the engine loaded KV it did not compute
    cached_tokens: int | None = None  # on the first delta: prompt tokens not computed (prefix cache, pool, peer)
    # When the request asked for logprobs: per token (token_id, logprob, rank, top) with top a list
    # of (token_id, logprob, rank), as vLLM's token-in/token-out server reports them.
    logprobs: list[Any] | None = None
    stop_reason: int | str | None = None  # the stop string or token id that ended the request

    def then(self, later: "TokenDelta") -> "TokenDelta":
        """This delta followed by a later one of the same request, as one delta."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        return TokenDelta(self.text + later.text, self.token_ids + later.token_ids, later.finish_reason,
                          later.prompt_tokens, later.completion_tokens, later.kv_transfer_params,
                          self.engine_timing or later.engine_timing, later.kv_load or self.kv_load,
                          self.cached_tokens if self.cached_tokens is not None else later.cached_tokens,
                          logprobs, later.stop_reason if later.stop_reason is not None else self.stop_reason)


@dataclass(frozen=True)
class EngineTiming:
    """Where the engine spent a request's time before its first token (engine-core clock)."""

    queue_s: float  # waiting queue: queued -> first scheduled
    first_token_s: float  # first scheduled -> first token (prompt compute, or KV pull + first step)


@dataclass(frozen=True)
class PrefillResult:
    """A finished prefill: its KV blocks are leased on the prefill replica until decode pulls."""

    transfer_params: TransferParams
    prompt_tokens: int
    prefill_s: float
    pool_load_s: float = 0.0  # of prefill_s: reading prompt blocks from the KV pool
    cached_tokens: int = 0  # prompt tokens the prefill did not compute (its prefix cache, the pool)
    pool_disk_load_s: float = 0.0  # of pool_load_s: chunks the pool's disk tier served


@dataclass(frozen=True)
class EngineFailure:
    """The engine could not run the request (yielded as a value, not raised across Ray).

    `message` is for logs and operators: it may name exceptions, hosts or replicas, so the
    ingress never shows it to clients, except for `invalid_request` failures, whose message is
    vLLM's own validation text about the client's request (as its server answers it)."""

    message: str
    retriable: bool = False
    # The engine refused the request itself (vLLM's engine-side validation: logprobs above
    # max_logprobs, a logit_bias id outside the vocabulary, ...): a 400, never retried.
    invalid_request: bool = False
    param: str | None = None  # with invalid_request: the request field vLLM named, if any


@dataclass(frozen=True)
class WaitExpired(EngineFailure):
    """A bounded wait of the request path expired (manifest request_timeouts); whoever yields it
    has aborted the request in the engine. The ingress answers 504 naming the wait."""

    wait: str = ""  # prefill, first_token, inter_token or total
    limit_s: float = 0.0


@dataclass
class ServerStats:
    """Counters of one engine server replica, for tests and `moe-serve status`."""

    replica_id: str
    started_total: int = 0
    finished_total: int = 0
    aborted_total: int = 0
    failed_total: int = 0
    abandoned_prefills_total: int = 0  # prefills whose caller left; their leases were released
    in_flight_request_ids: list[str] = field(default_factory=list)
    engine_unfinished_requests: int = 0  # requests the vLLM engine itself still tracks
    kv_transfer: dict[str, Any] = field(default_factory=dict)  # the connector's counters (disaggregated pools)
    # Expert-parallel groups: the group's totals above, each rank's own stats here.
    ranks: list["ServerStats"] = field(default_factory=list)
    routed_tokens_per_expert: dict[int, int] = field(default_factory=dict)  # global expert id -> tokens
    process_id: int = 0
