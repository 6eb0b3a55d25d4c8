"""Dependency-free TCP backend ("tcp"): a thread per connection on the prefill side, a small
connection pool on the decode side. Messages follow `kv_transfer.wire`.

    client                                   server
    READ_BLOCKS(rid, block_ids)      ->      source.pages(block_ids) (+ lease check)
                                     <-      DATA(rid, payload_len) + pages back to back
                                             | ERROR(rid, text)   (connection stays usable)
    RELEASE(rid)                     ->      on_release(rid)
                                     <-      OK(rid) | ERROR(rid, text)
    STATS                            ->      on_stats()
                                     <-      OK(payload = JSON)

The client checks DATA's payload length against its destination pages before reading a byte
and drops the connection on any mismatch, so a confused peer cannot overrun or misalign pages.
"""

from __future__ import annotations

from kv_transfer.transport import register_backend
from kv_transfer.transport.base import TransportBackend
from kv_transfer.transport.tcp_client import TcpTransferClient
from kv_transfer.transport.tcp_server import TcpTransferServer


@register_backend("tcp")
class TcpBackend(TransportBackend):
    server_cls = TcpTransferServer
    client_cls = TcpTransferClient
