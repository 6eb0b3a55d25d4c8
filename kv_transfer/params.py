"""Typed transfer parameters: what prefill hands to decode, and what each engine is asked.

They travel inside vLLM's `kv_transfer_params` dict (msgpack between engine processes, so
plain JSON-like values only); these records are the one place that knows the keys.

Deadlines across nodes: the lease's deadline is a time on the prefill node's clock, and only
the prefill side compares it with a clock (its own; the signed grant covers it). What crosses
to decode for its own decision is a duration: `lease_remaining_s`, the time the lease had left
when the params left the prefill node. Decode turns it into a deadline on its own monotonic
clock when its engine server receives the request (`received`), so decode's choice to start a
pull never depends on two nodes' clocks agreeing. The Ray hops in between (prefill replica ->
ingress -> decode replica) are not timed; `TRANSIT_ALLOWANCE_S` is taken off for them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kv_transfer.grants import GrantScope

PRODUCE_KEY = "do_remote_decode"  # prefill: keep the blocks and return TransferParams
CONSUME_KEY = "do_remote_prefill"  # decode: pull the blocks named by the params
LOAD_TIMING_KEY = "moe_serve_kv_load"  # a finished request's LoadTiming, when it loaded KV
SESSION_KEY = "moe_serve_session"  # the request belongs to a client's session (X-Session-Id): pin its pooled KV
TRANSIT_ALLOWANCE_S = 0.5  # untimed hops between the prefill node and decode's receipt (two Ray RPCs)


@dataclass(frozen=True)
class TransferParams:
    """Where a finished prefill's KV blocks are, and until when they are leased."""

    remote_host: str
    remote_port: int  # the prefill engine's first KV port: tensor-parallel rank r serves on remote_port + r
    remote_engine_id: str
    remote_request_id: str  # the prefill engine's internal id (vLLM suffixes external ids)
    remote_block_ids: tuple[int, ...]
    remote_num_tokens: int  # prompt tokens covered by the blocks
    block_size_tokens: int
    lease_deadline_unix_s: float
    inject_failure: bool = False  # fault injection for tests (only if the manifest allows it)
    grant: str = ""  # hex: the prefill's signed grant of exactly these blocks until its deadline
    # Seconds the lease had left as the params left the prefill node (a duration: no clock needed).
    lease_remaining_s: float | None = None
    # Set by decode's engine server on receipt: the deadline on the decode node's monotonic clock
    # (CLOCK_MONOTONIC, shared by the server, its engine core and workers on that node).
    lease_deadline_local_s: float | None = None
    # Tensor-parallel ranks of the prefill engine, each serving its own shard of every block.
    remote_tp_size: int = 1

    def rank_port(self, tp_rank: int) -> int:
        """Where prefill's rank `tp_rank` serves: a decode rank pulls and releases its own shard there."""
        if not 0 <= tp_rank < self.remote_tp_size:
            raise ValueError(f"tensor-parallel rank {tp_rank} of a {self.remote_tp_size}-rank prefill engine")
        return self.remote_port + tp_rank

    def rank_ports(self) -> range:
        """Every rank's port: a release from outside the workers frees the lease on all of them."""
        return range(self.remote_port, self.remote_port + self.remote_tp_size)

    def grant_bytes(self) -> bytes:
        return bytes.fromhex(self.grant) if self.grant else b""

    def to_engine(self) -> dict[str, Any]:
        """kv_transfer_params for the decode engine's request."""
        data = asdict(self)
        data["remote_block_ids"] = list(self.remote_block_ids)
        data[CONSUME_KEY] = True
        return data

    @classmethod
    def from_engine(cls, params: Any) -> "TransferParams":
        """The record in an engine's kv_transfer_params dict, every field checked for type and
        range (InvalidTransferParams names the first one that is not). The connector parses
        with this on vLLM's scheduler thread, where an exception would kill the engine core."""
        if not isinstance(params, dict):
            raise InvalidTransferParams(f"kv_transfer_params must be an object, got {type(params).__name__}")
        fields = {name: check(params.get(name, _MISSING), name) for name, check in _FIELD_CHECKS.items()}
        record = cls(**{k: v for k, v in fields.items() if v is not _MISSING})
        if record.remote_port + record.remote_tp_size - 1 > 65535:
            raise InvalidTransferParams(f"kv_transfer_params.remote_port {record.remote_port} leaves no port for "
                                        f"{record.remote_tp_size} tensor-parallel ranks")
        if record.remote_num_tokens > len(record.remote_block_ids) * record.block_size_tokens:
            raise InvalidTransferParams(f"remote_num_tokens {record.remote_num_tokens} is more than "
                                        f"{len(record.remote_block_ids)} blocks hold")
        return record

    def grant_scope(self) -> "GrantScope":
        """What the grant must have been signed over (kv_transfer.grants.GrantScope)."""
        from kv_transfer.grants import GrantScope

        return GrantScope(self.remote_engine_id, self.remote_host, self.remote_port, self.remote_request_id,
                          self.remote_block_ids, self.remote_tp_size)

    def received(self, now_s: float) -> "TransferParams":
        """Decode node, on receipt: the lease's deadline on this node's monotonic clock, as
        `received` does for the engine's dict."""
        if self.lease_remaining_s is None:
            return self
        return replace(self, lease_deadline_local_s=local_deadline(self.lease_remaining_s, now_s))

    def with_failure_injected(self) -> "TransferParams":
        return TransferParams(**{**asdict(self), "inject_failure": True})

    def ends_within(self, window_s: float, now_s: float, now_unix_s: float) -> bool:
        """Decode: whether the lease may end within `window_s` (so a pull must not start).
        `now_s`: this node's monotonic clock; `now_unix_s` is used only for params that never
        passed a receiving engine server (issued by a prefill that sends no remaining time)."""
        if self.lease_deadline_local_s is not None:
            return now_s + window_s > self.lease_deadline_local_s
        return now_unix_s + window_s > self.lease_deadline_unix_s


class InvalidTransferParams(ValueError):
    """kv_transfer_params that no engine of ours made: a field missing, of the wrong type or
    out of range."""


_MISSING = object()
MAX_ID_CHARS = 512
MAX_BLOCKS = 1 << 22  # far above any engine's block count; bounds the work of one record
MAX_TP_SIZE = 64  # the manifest's bound on engine.tensor_parallel_size


_Check = Callable[[Any, str], Any]  # (value as received, field name) -> the value, or InvalidTransferParams


def _required(check: _Check) -> _Check:
    def checked(value: Any, name: str) -> Any:
        if value is _MISSING:
            raise InvalidTransferParams(f"kv_transfer_params.{name} is missing")
        return check(value, name)
    return checked


def _optional(check: _Check, default: Any = _MISSING) -> _Check:
    def checked(value: Any, name: str) -> Any:
        if value is _MISSING:
            return default
        return None if value is None and default is None else check(value, name)
    return checked


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise InvalidTransferParams(f"kv_transfer_params.{name} must be a non-empty string of at most "
                                    f"{MAX_ID_CHARS} characters")
    return value


def _int_in(low: int, high: int) -> Callable[[Any, str], int]:
    def check(value: Any, name: str) -> int:
        # bool is an int in Python; JSON's true is not a port or a count.
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise InvalidTransferParams(f"kv_transfer_params.{name} must be an integer in [{low}, {high}]")
        return value
    return check


def _finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidTransferParams(f"kv_transfer_params.{name} must be a finite number")
    return float(value)


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidTransferParams(f"kv_transfer_params.{name} must be true or false")
    return value


def _block_ids(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_BLOCKS:
        raise InvalidTransferParams(f"kv_transfer_params.{name} must be a list of at most {MAX_BLOCKS} block ids")
    block = _int_in(0, 2**31 - 1)
    ids = tuple(block(b, name) for b in value)
    if len(set(ids)) != len(ids):
        raise InvalidTransferParams(f"kv_transfer_params.{name} names a block more than once")
    return ids


def _grant(value: Any, name: str) -> str:
    from kv_transfer.grants import PAYLOAD_BYTES

    if not isinstance(value, str) or len(value) not in (0, 2 * PAYLOAD_BYTES):
        raise InvalidTransferParams(f"kv_transfer_params.{name} must be a {2 * PAYLOAD_BYTES}-digit hex grant")
    try:
        bytes.fromhex(value)
    except ValueError:
        raise InvalidTransferParams(f"kv_transfer_params.{name} must be hex") from None
    return value


_FIELD_CHECKS = {
    "remote_host": _required(_text),
    "remote_port": _required(_int_in(1, 65535)),
    "remote_engine_id": _required(_text),
    "remote_request_id": _required(_text),
    "remote_block_ids": _required(_block_ids),
    "remote_num_tokens": _required(_int_in(0, 2**40)),
    "block_size_tokens": _required(_int_in(1, 1 << 16)),
    "lease_deadline_unix_s": _required(_finite),
    "inject_failure": _optional(_flag),
    "grant": _optional(_grant),
    "lease_remaining_s": _optional(_finite, default=None),
    "lease_deadline_local_s": _optional(_finite, default=None),
    "remote_tp_size": _optional(_int_in(1, MAX_TP_SIZE)),
}


@dataclass(frozen=True)
class LoadTiming:
    """How long the engine's worker spent loading KV that this request did not compute
    (worker clock; the request waits for both before its first step)."""

    pool_s: float = 0.0  # read from the KV pool (both tiers)
    pool_blocks: int = 0
    pull_s: float = 0.0  # pulled from the prefill's lease
    pull_blocks: int = 0
    pool_failed: bool = False  # a pool read failed (missing, corrupt, pool down): the engine recomputed
    # The pull from the prefill's lease failed and the engine recomputed. Whatever broke the pull
    # may have lost the release that follows it too: the P/D client then releases the lease itself.
    pull_failed: bool = False
    pool_disk_s: float = 0.0  # of pool_s: reads of chunks the pool's disk tier served
    pool_disk_blocks: int = 0

    def slower(self, other: "LoadTiming") -> "LoadTiming":
        """Ranks of one engine (tensor parallel) load their shards side by side: the request
        waits for the slowest of them."""
        return LoadTiming(max(self.pool_s, other.pool_s), max(self.pool_blocks, other.pool_blocks),
                          max(self.pull_s, other.pull_s), max(self.pull_blocks, other.pull_blocks),
                          self.pool_failed or other.pool_failed, self.pull_failed or other.pull_failed,
                          max(self.pool_disk_s, other.pool_disk_s), max(self.pool_disk_blocks, other.pool_disk_blocks))

    @classmethod
    def from_engine(cls, params: dict[str, Any] | None) -> "LoadTiming | None":
        """The timing in a finished request's kv_transfer_params, if it loaded anything."""
        data = (params or {}).get(LOAD_TIMING_KEY)
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data}) if data else None

    def to_engine(self) -> dict[str, Any]:
        return asdict(self)


def is_transfer(params: dict[str, Any] | None) -> bool:
    """Whether a finished prefill's kv_transfer_params name leased blocks (not only a timing)."""
    return params is not None and "remote_block_ids" in params


def in_session(params: Any) -> bool:
    """Whether a request's kv_transfer_params mark it as part of a session (set by our engine
    server from the ingress's X-Session-Id; a client cannot set kv_transfer_params)."""
    return isinstance(params, dict) and params.get(SESSION_KEY) is True


def prefill_request_params() -> dict[str, Any]:
    """kv_transfer_params for a prefill engine's request: compute the prompt, keep the blocks."""
    return {PRODUCE_KEY: True}


def handed_over(params: dict[str, Any], now_unix_s: float) -> dict[str, Any]:
    """Prefill node, as a finished prefill's params leave it: the lease time left, read off the
    deadline with this node's clock (the clock that set it). Never more than it was."""
    if not is_transfer(params) or "lease_deadline_unix_s" not in params:
        return params
    left_s = params["lease_deadline_unix_s"] - now_unix_s
    if params.get("lease_remaining_s") is not None:
        left_s = min(left_s, params["lease_remaining_s"])
    return {**params, "lease_remaining_s": left_s}


def received(params: dict[str, Any], now_s: float) -> dict[str, Any]:
    """Decode node, on receipt of a request to pull: the lease's deadline on this node's
    monotonic clock, `TRANSIT_ALLOWANCE_S` early for the untimed hops. Params without a
    remaining time (an older prefill) are left to the wall-clock check."""
    remaining_s = params.get("lease_remaining_s")
    if not params.get(CONSUME_KEY) or remaining_s is None:
        return params
    return {**params, "lease_deadline_local_s": local_deadline(remaining_s, now_s)}


def local_deadline(remaining_s: float, now_s: float) -> float:
    """A lease's end on the receiving node's monotonic clock, `TRANSIT_ALLOWANCE_S` early."""
    return now_s + remaining_s - TRANSIT_ALLOWANCE_S
