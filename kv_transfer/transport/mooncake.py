"""Mooncake backend ("mooncake"): page bytes move through Mooncake's transfer engine (its tcp or
rdma transport: kv_transfer.protocol and device_name), control stays on the "tcp" backend's
protocol. A dense cache in host memory (vLLM CPU) is registered and read in place; any other
(GPU memory, strided blocks) is staged through one host arena registered once
(kv_pages.RegisteredKVStaging), which the server keeps a described snapshot in until its release.

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
    moves_engine_memory = True  # in place for a dense host cache, else through a registered arena

    @classmethod
    def server_options(cls, transfer_timeout_s: float, protocol: str = "tcp", device_name: str = "") -> dict:
        # Described pages outlive any read the client still counts as in time.
        return {"hold_s": 2 * transfer_timeout_s + 1.0, "protocol": protocol, "device_name": device_name}

    @classmethod
    def client_options(cls, protocol: str = "tcp", device_name: str = "", local_host: str = "") -> dict:
        return {"protocol": protocol, "device_name": device_name, "local_host": local_host}
