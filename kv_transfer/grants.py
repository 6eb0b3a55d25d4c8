"""Signed lease grants: who may read (or release) a prefill's leased KV blocks (pure).

The KV transfer port serves raw KV pages, every user's prompts included, to whoever connects.
So the prefill side signs each lease it grants: an HMAC-SHA256, keyed by a secret that only the
application's engines hold, over the request id and the lease deadline on the prefill's own
clock. Decode sends the grant back with its READ (and RELEASE); the prefill's server answers
only when the MAC verifies and its own clock is before the deadline, and (as before) only for
blocks the lease covers once the worker knows the lease. Hence:

- a read for an invented request id is refused, whatever the race between the read and the
  lease table (the old "unknown id: serve everything" hole);
- a replayed grant is refused once its lease has ended, even after the server forgot the lease
  (blocks may by then hold another request's KV);
- deadlines are compared on one clock only (the prefill's), so nodes' clocks need not agree.

The block ids are not in the MAC: decode may pull a subset (the KV pool held the rest). In the
moment before the worker hears of a lease (one engine step) a valid grant is not yet limited to
its blocks; only holders of the secret (the engines) or of a grant sent to them can use that.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

GRANT_BYTES = 32  # SHA-256
_DEADLINE = struct.Struct("!Q")  # deadline, milliseconds since the epoch on the prefill's clock
PAYLOAD_BYTES = GRANT_BYTES + _DEADLINE.size  # what READ / RELEASE messages carry


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

    def sign(self, request_id: str, deadline_ms: int) -> bytes:
        message = request_id.encode("utf-8", "surrogatepass") + b"|" + str(int(deadline_ms)).encode()
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def payload(self, request_id: str, deadline_ms: int) -> bytes:
        """The grant bytes: what a client sends with its READ / RELEASE."""
        return self.sign(request_id, deadline_ms) + _DEADLINE.pack(int(deadline_ms))

    def check(self, request_id: str, payload: bytes, now_ms: int | None) -> str | None:
        """None when `payload` is this request's grant and, unless `now_ms` is None, still live."""
        if len(payload) != PAYLOAD_BYTES:
            return "no lease grant with the request"
        mac, (deadline_ms,) = payload[:GRANT_BYTES], _DEADLINE.unpack(payload[GRANT_BYTES:])
        if not hmac.compare_digest(mac, self.sign(request_id, deadline_ms)):
            return "the lease grant does not verify for this request"
        if now_ms is not None and now_ms >= deadline_ms:
            return "the lease grant has expired"
        return None
