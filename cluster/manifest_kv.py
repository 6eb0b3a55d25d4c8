"""The manifest's KV sections: how decode pulls KV from prefill (kv_transfer), and the
cluster-wide KV cache pool (kv_pool)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cluster.errors import ManifestIssue


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class KVTransferSpec(_Strict):
    """How decode pulls KV cache from prefill (disaggregated manifests)."""

    backend: Literal["tcp", "mooncake"] = "tcp"
    """Transport: tcp (dependency-free, our binary protocol), or mooncake (pages read through
    Mooncake's transfer engine, control over our protocol; needs Mooncake's wheel on prefill
    and decode nodes: mooncake-transfer-engine-cuda13 on GPU, -non-cuda on CPU)."""
    lease_s: Annotated[float, Field(gt=0, le=3600)] = 30.0
    """Prefill holds a finished prompt's blocks at most this long for decode to pull them.
    Decode starts a pull only if it can finish (transfer_timeout_s) before the deadline. Both
    grow with the prompt's KV bytes (min_transfer_mib_s)."""
    transfer_timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    """A pull slower than this, plus its bytes at min_transfer_mib_s, counts as failed;
    failure_policy then decides."""
    min_transfer_mib_s: Annotated[float, Field(ge=1, le=1_000_000)] = 64.0
    """The slowest rate a KV transfer may run at. A pull's bound (transfer_timeout_s) and the
    prefill's lease (lease_s) each grow by the KV's bytes at this rate, so one setting fits short
    prompts and 32k-token ones (the tiny DeepSeek's float32 latents: ~290 MiB, +4.5 s at 64)."""
    failure_policy: Literal["recompute", "fail"] = "recompute"
    """On a failed pull: recompute the prompt on decode (same output, slower), or fail the request."""
    allow_fault_injection: bool = False
    """Honour the X-Moe-Serve-Inject-KV-Failure: 1 request header (tests only)."""
    local_prefill_below_tokens: Annotated[int, Field(ge=0, le=1_048_576)] = 0
    """Conditional disaggregation: prompts shorter than this are prefilled by decode itself (no
    remote prefill, no transfer: shipping a few blocks costs more than computing them where they
    are needed). 0: every prompt goes through the prefill pool."""
    local_prefill_hit_fraction: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """Conditional disaggregation by cache: decode is chosen first (its pool's prefix router),
    and when that replica's prefix cache holds at least this fraction of the prompt, it prefills
    the rest itself instead of pulling it from a prefill replica. Needs the decode pool's
    `routing.policy: prefix` and `engine.enable_prefix_caching: true`. None: off."""
    protocol: Literal["tcp", "rdma"] = "tcp"
    """Mooncake's transport between engines (backend mooncake only): tcp runs anywhere; rdma
    needs RDMA NICs on prefill and decode nodes (kubernetes.rdma gives pods the devices)."""
    device_name: str = ""
    """RDMA devices for protocol rdma (e.g. mlx5_0,mlx5_1); empty: Mooncake finds them."""
    staging_mib: Annotated[int, Field(ge=16, le=1_048_576)] = 256
    """Backend mooncake: host memory each engine worker registers once to stage KV it cannot
    move in place (GPU caches): it bounds the KV one worker has in flight; a pull that finds it
    full fails (then failure_policy applies)."""


class KVPoolDiskSpec(_Strict):
    """A disk tier under the pool's DRAM: what the master evicts from an engine's segment is
    written to that engine's disk first, read from there on a hit and promoted back to memory
    on the second hit (Mooncake Store's offload; docs/long-context.md)."""

    path: str
    """Absolute directory on every engine node (a local SSD); each engine writes under
    path/<application>/<engine>, and removes its folder when it stops."""
    capacity_gib: Annotated[float, Field(gt=0, le=1_048_576)]
    """Disk each engine may fill; past it the least recently used objects are dropped."""

    @field_validator("path")
    @classmethod
    def _absolute(cls, path: str) -> str:
        if not path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"{path!r}: the disk tier needs an absolute path without '..' "
                             "(Mooncake refuses others), e.g. /mnt/nvme/moe-serve-kv")
        return path.rstrip("/") or "/"


class KVPoolSessionsSpec(_Strict):
    """Session-aware retention: requests with an `X-Session-Id` header store their blocks with a
    soft pin, so that while a session is active its history stays in DRAM and idle sessions'
    objects are evicted (with `disk`: demoted to disk) before it; each turn renews the pins of
    the history it reused (docs/long-context.md)."""

    idle_s: Annotated[float, Field(gt=0, le=86_400)] = 300.0
    """How long after its last turn a session's history stays pinned."""
    max_pinned_share: Annotated[float, Field(gt=0, le=0.9)] = 0.5
    """The share of an engine's segment its pins may take; the rest stays evictable, so pinned
    objects never leave the master nothing to evict (past it, blocks are stored unpinned)."""


class KVPoolSpec(_Strict):
    """A cluster-wide KV cache pool (Mooncake Store) shared by prefill, decode and colocated
    engines: prefix blocks computed anywhere are loaded instead of recomputed, and decode
    stores whole conversations (generated tokens included) for their next turn."""

    enabled: bool = False
    """Start the pool's master with the application and give every engine a pool tier."""
    backend: Literal["mooncake"] = "mooncake"
    """The store: mooncake (Mooncake Store; needs the Mooncake wheel on every engine node)."""
    segment_mib: Annotated[int, Field(ge=16, le=4_194_304)] = 256
    """Memory each engine contributes to the pool, on the node it runs on (the pool's capacity
    is this times the engines; `moe-serve plan` shows it in tokens of the model)."""
    prefill_segment_mib: Annotated[int, Field(ge=0, le=4_194_304)] | None = None
    """Memory each prefill engine contributes instead (default: segment_mib). 0 keeps every
    object of a P/D application in decode's segments, where decode reads it back each turn: a
    read from an engine's own segment is a local copy, about 3x faster than a remote read over
    TCP (BENCHMARKS.md 8c). Prefill still stores and loads; its writes cross to decode."""

    def segment_mib_for(self, role: str) -> int:
        """What one engine of a pool with this role contributes."""
        if role == "prefill" and self.prefill_segment_mib is not None:
            return self.prefill_segment_mib
        return self.segment_mib

    @field_validator("prefill_segment_mib")
    @classmethod
    def _mooncake_segment_minimum(cls, mib: int | None) -> int | None:
        if mib is not None and 0 < mib < 16:
            raise ValueError(f"{mib} MiB: Mooncake needs 0 (prefill contributes nothing) or at least 16")
        return mib
    local_buffer_mib: Annotated[int, Field(ge=4, le=65_536)] = 64
    """Each engine's transfer buffer (and its staging for blocks in flight)."""
    disk: KVPoolDiskSpec | None = None
    """A disk tier under the DRAM segments (path, capacity_gib); None: DRAM only."""
    sessions: KVPoolSessionsSpec | None = None
    """Keep active sessions' history in DRAM (idle_s, max_pinned_share); None: the master
    evicts by its own order, sessions or not."""
    protocol: Literal["tcp", "rdma"] = "tcp"
    """Transport between pool clients: tcp (anywhere, CPU included) or rdma (GPU clusters)."""
    device_name: str = ""
    """RDMA device names for protocol rdma (e.g. mlx5_0,mlx5_1); empty for tcp."""
    master_rpc_port: Annotated[int | None, Field(ge=1, le=65535)] = None
    """RPC port of the pool's master on the head node (a free port when unset)."""
    master_http_port: Annotated[int | None, Field(ge=1, le=65535)] = None
    """Port of the master's HTTP metadata server (a free port when unset)."""
    retry_after_s: Annotated[float, Field(gt=0, le=3600)] = 10.0
    """After a pool call fails, engines serve without the pool this long, then try again."""
    max_pending_stores: Annotated[int, Field(ge=1, le=100_000)] = 64
    """Stores an engine may have queued or running; past it a finished request's blocks are
    freed without being stored (a cache can drop writes; a slow pool must not hold engine KV)."""
    max_store_wait_s: Annotated[float, Field(gt=0, le=3600)] = 5.0
    """A store queued longer than this is dropped when its turn comes."""
    weights_id: str = ""
    """A name for the checkpoint's weights in the pool's keys (e.g. a commit or content hash),
    instead of the weights files' sizes and modification times: set it when engines of one
    application load separate copies of the same checkpoint (each node its own download),
    whose times differ, or they will never share pooled KV."""


def kv_connector_issues(manifest: Any) -> list[ManifestIssue]:
    """Tensor parallelism with our KV connector: each TP worker serves its shard of the blocks
    (its KV heads) on its own port (the engine's first port + its rank), and decode's rank r
    pulls from prefill's rank r. So the two pools of a P/D manifest need the same
    tensor_parallel_size; mapping heads between different sizes is not implemented. A KV pool
    keys each rank's shard (and the TP layout) separately, so it needs nothing more.
    `manifest` is a cluster.manifest.Manifest."""
    if not manifest.disaggregated:
        return []
    sizes = {pool.role.value: (index, pool) for index, pool in enumerate(manifest.pools)
             if pool.role.value in ("prefill", "decode")}
    if set(sizes) != {"prefill", "decode"}:
        return []
    (_, prefill), (decode_index, decode) = sizes["prefill"], sizes["decode"]
    prefill_tp, decode_tp = prefill.engine.tensor_parallel_size, decode.engine.tensor_parallel_size
    ep_with_tp = any(pool.expert_parallel is not None and pool.engine.tensor_parallel_size > 1
                     for pool in (prefill, decode))
    if prefill_tp == decode_tp or ep_with_tp:
        return []  # an expert-parallel pool with TP > 1 is refused on its own (one issue, not two)
    return [ManifestIssue(
        f"pools[{decode_index}].engine.tensor_parallel_size", decode_tp,
        f"the prefill pool {prefill.name!r} runs tensor_parallel_size {prefill_tp} and the decode pool "
        f"{decode.name!r} {decode_tp}: each decode rank pulls the KV heads that the prefill rank of the "
        "same number holds, and mapping heads between different TP sizes is not implemented",
        f"give both pools the same tensor_parallel_size (e.g. {prefill_tp})")]
