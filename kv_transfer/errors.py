"""Errors of the KV transfer path.

Every failure the transfer path can raise is a `KVTransferError`, so the connector can catch
the family once (and fall back to recomputing the prefill) without catching unrelated bugs.
"""

from __future__ import annotations


class KVTransferError(Exception):
    """Base of all KV transfer failures."""


class WireError(KVTransferError):
    """A message on the wire is malformed or breaks a protocol limit.

    Raised both when decoding (a peer sent garbage) and when encoding (we were asked to send
    something the format cannot carry, such as a 300-byte request id).
    """


class TransferTimeout(KVTransferError):
    """A transfer did not complete within its deadline."""

    def __init__(self, message: str, timeout_s: float):
        super().__init__(message)
        self.timeout_s = timeout_s


class TransferFailed(KVTransferError):
    """The peer answered with an error, sent something unexpected, or the connection dropped."""

    def __init__(self, message: str, *, remote: bool = False):
        super().__init__(message)
        # True when the text came from the peer's ERROR reply (the connection is still fine);
        # False when the failure was local or of the connection itself.
        self.remote = remote


class LeaseExistsError(KVTransferError):
    """A lease was granted twice for one request; the first grant's blocks would leak."""

    def __init__(self, request_id: str):
        super().__init__(
            f"request {request_id!r} already holds a lease; release it before granting again")
        self.request_id = request_id


class UnknownBackendError(KVTransferError):
    """No transport backend is registered under the requested name."""

    def __init__(self, name: str, known: list[str]):
        super().__init__(
            f"unknown KV transport backend {name!r}; known backends: {', '.join(known) or '(none)'}")
        self.name = name
        self.known = known
