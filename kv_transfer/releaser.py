"""Lease releases sent from the engine-core (scheduler) process, off the scheduler's thread.

The scheduler decides that a prefill's lease is no longer needed (a decode request aborted
before it pulled) at a moment when no engine step may follow, so the worker cannot carry the
release. Releases are control messages of our TCP protocol, which every backend's server
speaks (Mooncake moves only the data), so the plain TCP client serves all of them.

The worker sends its releases through one of these too, on threads of their own, so that a
release to a dead prefill node never holds a thread that a pull is waiting for. A peer that
was unreachable is not tried again for a while (`peer_health`): a dead node costs one timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kv_transfer.errors import TransferFailed
from kv_transfer.params import TransferParams
from kv_transfer.peer_health import PeerDown, PeerHealth, PeerUnreachable, guarded
from kv_transfer.transport.base import TransferClient
from kv_transfer.transport.tcp_client import TcpTransferClient

logger = logging.getLogger(__name__)

# Pauses before the retries of a release whose connection broke. Not for a peer found down (the
# back-off owns that) or a refusal (the server answered: trying again gets the same answer).
RETRY_AFTER_S = (0.2, 1.0)


def _worth_retrying(exc: Exception) -> bool:
    if isinstance(exc, (PeerDown, PeerUnreachable)):
        return False
    return isinstance(exc, TransferFailed) and not exc.remote


class BackgroundReleaser:
    """`client`: a client to share (not closed here); `peers`: the back-off record to share
    with the caller's pulls; `on_failure(exc)`: called for each release that failed or was skipped
    (PeerDown)."""

    def __init__(self, timeout_s: float, *, client: TransferClient | None = None, peers: PeerHealth | None = None,
                 on_failure: Callable[[Exception], None] | None = None, threads: int = 1):
        self._timeout_s = timeout_s
        self._owns_client = client is None
        self._client = client if client is not None else TcpTransferClient()
        self._peers = peers if peers is not None else PeerHealth(probe_s=timeout_s)
        self._on_failure = on_failure
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kv-release")

    def submit(self, params: TransferParams, tp_ranks: Sequence[int] | None = None) -> None:
        """Release the lease on the prefill engine's tensor-parallel ranks `tp_ranks` (None:
        every rank; each holds the lease on its own shard of the blocks)."""
        for port in (params.rank_ports() if tp_ranks is None else [params.rank_port(r) for r in tp_ranks]):
            self._submit(params, port, 0)

    def _submit(self, params: TransferParams, port: int, attempt: int) -> None:
        try:
            self._pool.submit(self._release, params, port, attempt)
        except RuntimeError:  # shut down meanwhile (a retry's timer fired late): nothing to do
            pass

    def _release(self, params: TransferParams, port: int, attempt: int = 0) -> None:
        try:
            with guarded(self._peers, params.remote_host, port):
                self._client.release(params.remote_host, port, params.remote_request_id,
                                     self._timeout_s, params.remote_block_ids, params.grant_bytes())
        except Exception as exc:  # the prefill side's lease deadline frees the blocks anyway
            if _worth_retrying(exc) and attempt < len(RETRY_AFTER_S):
                # A connection that broke under this release (CI: closed before the reply) says
                # nothing of the next one; a lost release pins the blocks for the whole lease.
                timer = threading.Timer(RETRY_AFTER_S[attempt], self._submit, (params, port, attempt + 1))
                timer.daemon = True
                timer.start()
                return
            if self._on_failure is not None:
                self._on_failure(exc)
            log = logger.debug if isinstance(exc, PeerDown) else logger.warning  # PeerDown: logged once, at the failure
            log("kv transfer: release of %s on %s:%s failed: %s", params.remote_request_id,
                params.remote_host, port, exc)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._owns_client:
            self._client.close()
