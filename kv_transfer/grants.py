"""Signed lease grants: who may read (or release) a prefill's leased KV blocks (pure).

The KV transfer port serves raw KV pages, every user's prompts included. So the prefill side
signs each lease it grants: an HMAC-SHA256, keyed by a secret that only the application's
engines hold, over everything the grant names (`GrantScope`: the engine, the address it serves
on and its tensor-parallel size, the request, the exact blocks) and the lease deadline on the
prefill's own clock. Hence:

- a grant opens one lease on one engine: presented to another engine of the application, for
  another request, or for blocks the lease does not hold, it does not verify. A tensor-parallel
  engine serves on one port per rank (`port + rank`) and signs with its first port and its TP
  size, so one grant opens the lease on each of its ranks and a record whose TP size was
  changed (to send decode ranks to other ports) does not verify;
- decode checks the grant before it pulls, so transfer parameters that no engine of this
  application signed (a forged or tampered record) never make it connect anywhere: pulls go
  only to engines of its own application, and only to the address the prefill signed;
- a replayed grant is refused once its lease has ended (blocks may by then hold another
  request's KV), and deadlines are compared on one clock only (the prefill's).

Decode may pull a subset of the blocks (its cache or the KV pool held the rest): the server
checks the grant against the lease's full block list and the read against the lease.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

GRANT_BYTES = 32  # SHA-256
_DEADLINE = struct.Struct("!Q")  # deadline, milliseconds since the epoch on the prefill's clock
PAYLOAD_BYTES = GRANT_BYTES + _DEADLINE.size  # what READ / RELEASE messages carry
_FIELD_LEN = struct.Struct("!I")


@dataclass(frozen=True)
class GrantScope:
    """What one grant opens: these blocks of this request's lease on this engine (`port`: its
    first KV port; `tp_size`: how many ranks serve from there on)."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: tuple[int, ...]
    tp_size: int = 1

    def message(self, deadline_ms: int) -> bytes:
        # Length-prefixed fields: no choice of ids can make two scopes sign the same bytes.
        parts = [self.engine_id.encode("utf-8", "surrogatepass"), self.host.encode("utf-8", "surrogatepass"),
                 str(int(self.port)).encode(), self.request_id.encode("utf-8", "surrogatepass"),
                 struct.pack(f"!{len(self.block_ids)}I", *self.block_ids), str(int(deadline_ms)).encode()]
        if self.tp_size != 1:  # TP 1 signs as before, so engines of the last release still verify
            parts.append(str(int(self.tp_size)).encode())
        return b"".join(_FIELD_LEN.pack(len(p)) + p for p in parts)


class GrantKey:
    """The application's secret (hex in the connector settings; never logged)."""

    def __init__(self, secret_hex: str):
        try:
            secret = bytes.fromhex(secret_hex)
        except ValueError:
            secret = b""
        if len(secret) < 16:
            raise ValueError("the KV grant secret must be at least 16 bytes, as hex (32+ characters)")
        self._secret = secret

    def __repr__(self) -> str:
        return "GrantKey(<secret>)"

    def sign(self, scope: GrantScope, deadline_ms: int) -> bytes:
        return hmac.new(self._secret, scope.message(deadline_ms), hashlib.sha256).digest()

    def payload(self, scope: GrantScope, deadline_ms: int) -> bytes:
        """The grant bytes: what decode sends with its READ / RELEASE."""
        return self.sign(scope, deadline_ms) + _DEADLINE.pack(int(deadline_ms))

    def check(self, scope: GrantScope, payload: bytes, now_ms: int | None) -> str | None:
        """None when `payload` is the grant of exactly `scope` and, unless `now_ms` is None,
        still live; else why not."""
        if len(payload) != PAYLOAD_BYTES:
            return "no lease grant with the request"
        mac, (deadline_ms,) = payload[:GRANT_BYTES], _DEADLINE.unpack(payload[GRANT_BYTES:])
        if not hmac.compare_digest(mac, self.sign(scope, deadline_ms)):
            return "the lease grant does not verify for this engine, request and blocks"
        if now_ms is not None and now_ms >= deadline_ms:
            return "the lease grant has expired"
        return None


def live_deadline(payload: bytes, now_ms: int) -> bool:
    """Whether `payload` could be a live grant: the right length and a deadline still ahead.
    Not a check of who signed it (that needs the lease's blocks): a cheap first filter, so a
    read without even that is refused before it may wait for a lease."""
    return len(payload) == PAYLOAD_BYTES and _DEADLINE.unpack(payload[GRANT_BYTES:])[0] > now_ms


class EngineGrants:
    """One serving engine's check of the grants presented to it: the key plus the identity the
    engine signs with, so a grant minted by another engine never opens this one."""

    def __init__(self, key: GrantKey, engine_id: str, host: str, port: int, tp_size: int = 1):
        """`port`: the engine's first KV port (every rank checks against the same scope)."""
        self._key = key
        self._engine = (engine_id, host, port)
        self._tp_size = tp_size

    def check(self, request_id: str, block_ids: Sequence[int], payload: bytes, now_ms: int | None) -> str | None:
        scope = GrantScope(*self._engine, request_id=request_id, block_ids=tuple(block_ids), tp_size=self._tp_size)
        return self._key.check(scope, payload, now_ms)
