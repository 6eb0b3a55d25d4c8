"""Connector settings, passed to both connector roles through kv_connector_extra_config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_transfer.grants import EngineGrants, GrantKey


@dataclass(frozen=True)
class ConnectorSettings:
    backend: str = "tcp"  # transport backend name (kv_transfer.transport registry)
    host: str = "127.0.0.1"  # where this engine's worker serves its blocks
    # Fixed by the engine server before the engine starts (both roles must agree): the first of
    # `tp_size` consecutive ports, one per tensor-parallel worker (rank r serves on port + r).
    port: int = 0
    tp_size: int = 1
    engine_id: str = ""
    lease_s: float = 10.0  # prefill keeps blocks at most this long for a decode that never pulls
    transfer_timeout_s: float = 5.0  # a pull slower than this fails (then the failure policy applies)
    # The slowest rate a KV transfer may run at. A pull's bound, the prefill's lease and the
    # server's send each grow by their bytes at this rate (`transfer_budget_s`, `lease_for_s`),
    # so one setting fits a 16-token prompt and a 32k-token one (~290 MiB of the tiny
    # DeepSeek's float32 latents, ~5 GB of DeepSeek-V3's fp8 ones at 128k).
    min_transfer_bytes_per_s: float = 64 << 20
    failure_policy: str = "recompute"  # recompute | fail (mirrors vLLM's kv_load_failure_policy)
    max_concurrent_pulls: int = 4
    pool: dict[str, Any] | None = None  # kv_transfer.pool.store.PoolSettings as a dict; None: no pool
    # Hex secret shared by the application's engines: prefill signs its lease grants with it,
    # serves reads only for a grant that verifies, and decode pulls only for parameters whose
    # grant verifies (kv_transfer.grants). Empty: this engine neither lends nor pulls KV.
    grant_secret: str = field(default="", repr=False)
    # Whether this engine lends its KV blocks to others (a prefill pool's engines): only those
    # keep blocks under leases and answer reads; the others' transfer port answers releases
    # and stats only.
    lends_kv: bool = False
    # The "mooncake" backend's registered host staging per worker, for caches it cannot move in
    # place (GPU memory, strided blocks): bounds the KV in flight (sent and received) at once.
    staging_bytes: int = 256 << 20
    # Mooncake's transport between engines (backend "mooncake"): tcp, or rdma over device_name's NICs.
    protocol: str = "tcp"
    device_name: str = ""
    # Connections the transfer server serves at once, sized by the builder from the topology
    # (every decode rank's pull pool plus releasers); past it idle ones are closed first.
    max_connections: int = 256

    def to_extra_config(self) -> dict[str, Any]:
        return asdict(self)

    def transfer_budget_s(self, nbytes: int) -> float:
        """How long moving `nbytes` of KV may take: transfer_timeout_s (connecting, the first
        byte, a busy peer) plus the bytes at the slowest rate accepted."""
        return self.transfer_timeout_s + max(nbytes, 0) / self.min_transfer_bytes_per_s

    def lease_for_s(self, nbytes: int) -> float:
        """How long prefill holds `nbytes` of blocks for decode: lease_s (decode's queue and the
        pull's fixed part) plus the bytes' time on the wire, so that decode may start a long
        prompt's pull as late as a short one's (a pull starts only if its budget fits)."""
        return self.lease_s + max(nbytes, 0) / self.min_transfer_bytes_per_s

    def rank_port(self, tp_rank: int) -> int:
        """The port tensor-parallel worker `tp_rank` serves its shard of the engine's blocks on."""
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tensor-parallel rank {tp_rank} of a {self.tp_size}-rank engine")
        return self.port + tp_rank if self.port else 0

    def rank_ports(self) -> range:
        return range(self.port, self.port + self.tp_size)

    def grant_key(self) -> "GrantKey | None":
        """The GrantKey of `grant_secret`, or None without one (no KV is then lent or pulled)."""
        from kv_transfer.grants import GrantKey

        return GrantKey(self.grant_secret) if self.grant_secret else None

    def engine_grants(self) -> "EngineGrants | None":
        """This engine's check of the grants presented to its transfer server (None: no secret)."""
        from kv_transfer.grants import EngineGrants

        key = self.grant_key()
        # Every rank checks grants against the engine's first port and TP size (grants.py).
        return EngineGrants(key, self.engine_id, self.host, self.port, self.tp_size) if key is not None else None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        unknown = set(extra) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown kv connector settings {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}")
        settings = cls(**extra)
        if settings.pool is not None:
            from kv_transfer.pool.store import PoolSettings

            PoolSettings.from_dict(settings.pool)  # fails here, naming the field, not in an engine step
        if settings.grant_secret:
            from kv_transfer.grants import GrantKey

            GrantKey(settings.grant_secret)  # a malformed secret fails here, not on the first read
        if not 1 <= settings.tp_size <= 64 or settings.port + settings.tp_size - 1 > 65535:
            raise ValueError(f"tp_size {settings.tp_size} with first port {settings.port}: needs 1-64 ranks "
                             "and a port for each")
        if settings.failure_policy not in ("recompute", "fail"):
            raise ValueError(f"failure_policy must be recompute or fail, got {settings.failure_policy!r}")
        if not settings.min_transfer_bytes_per_s > 0:
            raise ValueError(f"min_transfer_bytes_per_s must be above 0, got {settings.min_transfer_bytes_per_s}")
        return settings
