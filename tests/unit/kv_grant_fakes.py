"""Grants and leases for tests of the KV transport and the connector's worker side.

A transfer server answers a read only under a lease it knows and a live grant of exactly that
lease (kv_transfer/grants.py). Transport tests are about moving bytes, so they serve from a
lease table in which every request holds every block (`EveryBlockLeased`) and sign grants for
that lease (`grant_for`, or `GrantingClient` around a client); the tests of who may read
what use the real LeaseTable and WorkerSide (test_kv_port_security.py).
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


class GrantingClient:
    """A transfer client that presents, with each fetch and release, a grant of the lease every
    request holds under `EveryBlockLeased(num_blocks)` (for `engine_grants()`); an explicit
    `grant` (or release `block_ids`) is sent as given. Everything else is the wrapped client's."""

    def __init__(self, client, num_blocks: int):
        self._client = client
        self._lease_block_ids = tuple(range(num_blocks))

    def fetch(self, host, port, request_id, remote_block_ids, dest_pages, timeout_s, grant=None):
        grant = grant_for(request_id, self._lease_block_ids) if grant is None else grant
        return self._client.fetch(host, port, request_id, remote_block_ids, dest_pages, timeout_s, grant)

    def release(self, host, port, request_id, timeout_s, block_ids=None, grant=None):
        if block_ids is None:
            block_ids = self._lease_block_ids
        grant = grant_for(request_id, block_ids) if grant is None else grant
        self._client.release(host, port, request_id, timeout_s, block_ids, grant)

    def __getattr__(self, name):
        return getattr(self._client, name)
