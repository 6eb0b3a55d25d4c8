"""Mooncake backend ("mooncake"): page bytes move through Mooncake's transfer engine (its TCP
protocol; RDMA is not wired up here), control stays on the "tcp" backend's protocol.

    client                                   server (owns a TransferEngine; page memory registered)
    DESCRIBE_BLOCKS(rid, block_ids)  ->      lease check, source.pages(block_ids)
                                     <-      OK(page table: rpc_port, [(address, nbytes)] layer-major)
                                             | ERROR(rid, text)
    engine.batch_transfer_sync_read(host:rpc_port, dest addresses, page addresses, sizes)
                                             (adjacent pages in registered regions: one range)
    RELEASE(rid) / STATS             ->      as in "tcp"

The server registers a source's `regions()` once at start (else each page on first DESCRIBE);
the client registers a sink's `regions()` in `register_sink` (else each dest page on first
use). The lease is checked when the pages are described, not when Mooncake reads them, so the
client treats a read that ends after its deadline as failed (the blocks may have been reused).
Needs the `mooncake-transfer-engine-non-cuda` wheel on CPU (`-cuda13` on GPUs), imported only when this
backend is chosen.
"""

from __future__ import annotations

try:
    import mooncake.engine  # noqa: F401  (fail when the backend is chosen, not at first pull)
except ImportError as exc:
    raise ImportError("the 'mooncake' KV transport needs Mooncake's transfer engine: pip install "
                      "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine-cuda13 (CUDA), "
                      f"or choose kv_transfer.backend: tcp ({exc})") from exc

from kv_transfer.transport import register_backend
from kv_transfer.transport.base import TransportBackend
from kv_transfer.transport.mooncake_client import MooncakeTransferClient
from kv_transfer.transport.mooncake_server import MooncakeTransferServer


@register_backend("mooncake")
class MooncakeBackend(TransportBackend):
    server_cls = MooncakeTransferServer
    client_cls = MooncakeTransferClient
    moves_engine_memory = True  # so a host-memory cache only, until device memory is registered
