"""Lease releases sent from the engine-core (scheduler) process, off the scheduler's thread.

The scheduler decides that a prefill's lease is no longer needed (a decode request aborted
before it pulled) at a moment when no engine step may follow, so the worker cannot carry the
release. Releases are control messages of our TCP protocol, which every backend's server
speaks (Mooncake moves only the data), so the plain TCP client serves all of them.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from kv_transfer.params import TransferParams
from kv_transfer.transport.tcp_client import TcpTransferClient

logger = logging.getLogger(__name__)


class BackgroundReleaser:
    def __init__(self, timeout_s: float):
        self._timeout_s = timeout_s
        self._client = TcpTransferClient()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-release")

    def submit(self, params: TransferParams) -> None:
        self._pool.submit(self._release, params)

    def _release(self, params: TransferParams) -> None:
        try:
            self._client.release(params.remote_host, params.remote_port, params.remote_request_id, self._timeout_s,
                                 params.remote_block_ids, params.grant_bytes())
        except Exception as exc:  # the prefill side's lease deadline frees the blocks anyway
            logger.warning("kv transfer: release of %s on %s:%s failed: %s", params.remote_request_id,
                           params.remote_host, params.remote_port, exc)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
