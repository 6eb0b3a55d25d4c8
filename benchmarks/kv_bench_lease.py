"""The lease a transport benchmark reads under: a transfer server answers a read only for a
lease it knows and a live grant of exactly that lease (kv_transfer/grants.py), so a benchmark
that serves blocks from a bare server must hold one too, as a prefill engine would."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

from kv_transfer.grants import EngineGrants, GrantKey, GrantScope
from kv_transfer.leases import Lease

REQUEST_ID = "bench"
ENGINE_ID = "bench-engine"


@dataclass(frozen=True)
class BenchLease:
    """Pass `leases` and `grant_key` to the server, `grant` with each fetch."""

    leases: _OneLease
    grant_key: EngineGrants
    grant: bytes


class _OneLease:
    def __init__(self, block_ids: tuple[int, ...]):
        self._lease = Lease(REQUEST_ID, block_ids, 0.0, float("inf"))

    def get(self, request_id: str) -> Lease | None:
        return self._lease if request_id == REQUEST_ID else None


def bench_lease(num_blocks: int, host: str = "127.0.0.1", lease_s: float = 24 * 3600.0) -> BenchLease:
    """A lease of blocks 0..num_blocks-1 for REQUEST_ID on a server bound to `host` (any port:
    servers on an ephemeral port sign as port 0)."""
    key = GrantKey(secrets.token_hex(32))
    block_ids = tuple(range(num_blocks))
    scope = GrantScope(ENGINE_ID, host, 0, REQUEST_ID, block_ids)
    grant = key.payload(scope, int((time.time() + lease_s) * 1000))
    return BenchLease(_OneLease(block_ids), EngineGrants(key, ENGINE_ID, host, 0), grant)
