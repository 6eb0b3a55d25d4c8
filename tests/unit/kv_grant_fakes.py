"""Grants and leases for tests of the KV transport and the connector's worker side.

A transfer server answers a read only under a lease it knows and a live grant of exactly that
lease (kv_transfer/grants.py). Transport tests are about moving bytes, so they serve from a
lease table in which every request holds every block (`EveryBlockLeased`) and sign grants for
that lease (`grant_for`); the tests of who may read what use the real LeaseTable.
"""

from __future__ import annotations

import time
from dataclasses import replace

from kv_transfer.grants import EngineGrants, GrantKey, GrantScope
from kv_transfer.leases import Lease
from kv_transfer.params import TransferParams

SECRET = "ab" * 32
ENGINE_ID = "engine-under-test"


def engine_grants(host: str = "127.0.0.1", port: int = 0, engine_id: str = ENGINE_ID) -> EngineGrants:
    """A serving engine's grant check (port 0: servers bound to an ephemeral port sign as 0)."""
    return EngineGrants(GrantKey(SECRET), engine_id, host, port)


class EveryBlockLeased:
    """A lease lookup in which any request holds blocks 0..num_blocks-1 (transport tests only)."""

    def __init__(self, num_blocks: int):
        self.block_ids = tuple(range(num_blocks))

    def get(self, request_id: str) -> Lease:
        return Lease(request_id, self.block_ids, 0.0, float("inf"))


def grant_for(request_id: str, lease_block_ids, *, host: str = "127.0.0.1", port: int = 0,
              engine_id: str = ENGINE_ID, lease_s: float = 60.0, secret: str = SECRET) -> bytes:
    deadline_ms = int((time.time() + lease_s) * 1000)
    scope = GrantScope(engine_id, host, port, request_id, tuple(lease_block_ids))
    return GrantKey(secret).payload(scope, deadline_ms)


def signed(params: TransferParams, secret: str = SECRET) -> TransferParams:
    """`params` as the prefill engine that issued them would sign them."""
    grant = GrantKey(secret).payload(params.grant_scope(), int(params.lease_deadline_unix_s * 1000))
    return replace(params, grant=grant.hex())
