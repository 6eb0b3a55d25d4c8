"""Client half of the "mooncake" KV transport (see `mooncake` for the protocol).

A fetch asks the server over the pooled TCP control connection where the pages are
(DESCRIBE_BLOCKS), checks the page table against the destination pages, then reads every page
with one Mooncake batch read straight into the destination memory (pages adjacent on both
sides merged into one range, `plan_reads`). RELEASE and STATS are the "tcp" client's.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from kv_transfer import wire
from kv_transfer.errors import TransferFailed, TransferTimeout
from kv_transfer.transport.base import FetchResult, HasRegions, PageSink
from kv_transfer.transport.mooncake_memory import MemoryRegistry, new_engine
from kv_transfer.transport.sockio import Deadline, dest_views, recv_exact
from kv_transfer.transport.tcp_client import TcpTransferClient
from kv_transfer.wire import MessageType


class MooncakeTransferClient(TcpTransferClient):
    """Owns one TransferEngine, started on the first fetch (or `register_sink`).

    Mooncake's synchronous read cannot be given a deadline; a read that ends after `timeout_s`
    raises TransferTimeout all the same, because the server may have reused the blocks by then.
    """

    def __init__(self, *, max_idle_per_peer: int = 4, protocol: str = "tcp", device_name: str = "",
                 local_host: str = ""):
        """`local_host`: the address this engine is reached at (its name in RDMA handshakes);
        empty: the local address of the route towards the first peer."""
        super().__init__(max_idle_per_peer=max_idle_per_peer)
        self._protocol, self._device_name, self._local_host = protocol, device_name, local_host
        self._engine_lock = threading.Lock()
        self._engine = None
        self._memory: MemoryRegistry | None = None

    def register_sink(self, sink: PageSink) -> None:
        if isinstance(sink, HasRegions):
            # No peer known yet: without local_host the engine is named by loopback, which
            # matters only for RDMA (WorkerSide passes its serving address).
            self._local_memory("127.0.0.1").add_regions(sink.regions())

    def fetch(self, host, port, request_id, remote_block_ids, dest_pages, timeout_s, grant=b"") -> FetchResult:
        views = dest_views(dest_pages, remote_block_ids)
        started_s = time.perf_counter()

        def read_table(sock: socket.socket, deadline: Deadline) -> wire.PageTable:
            header = self._reply(sock, deadline, request_id, MessageType.OK,
                                 wire.page_table_bytes(len(views)))
            return wire.decode_page_table(recv_exact(sock, header.payload_len_bytes, deadline))

        request = wire.encode_describe_blocks(request_id, remote_block_ids, grant)
        table = self._exchange(host, port, timeout_s, request, read_table)
        _check_table(table, views, request_id)
        memory = self._local_memory(host)
        local = [memory.ensure(v) for v in views]
        reads = plan_reads(local, table)
        if time.perf_counter() - started_s >= timeout_s:
            raise TransferTimeout(f"fetch of {request_id!r} ran out of its {timeout_s} s "
                                  f"before the Mooncake read", timeout_s)
        if reads.lengths:
            self._read(f"{host}:{table.rpc_port}", reads, request_id)
        seconds = time.perf_counter() - started_s
        if seconds > timeout_s:
            raise TransferTimeout(f"Mooncake read of {request_id!r} took {seconds:.3f} s, over "
                                  f"its {timeout_s} s: the blocks may have been reused", timeout_s)
        return FetchResult(sum(reads.lengths), seconds)

    def _read(self, target: str, reads: "Reads", request_id: str) -> None:
        engine = self._engine
        if hasattr(engine, "batch_transfer_sync_read"):
            rc = engine.batch_transfer_sync_read(target, reads.local, reads.remote, reads.lengths)
        else:  # older wheels: one read per range
            rc = 0
            for args in zip(reads.local, reads.remote, reads.lengths):
                rc = engine.transfer_sync_read(target, *args)
                if rc < 0:
                    break
        if rc < 0:
            raise TransferFailed(f"Mooncake read of {len(reads.lengths)} ranges of {request_id!r} "
                                 f"from {target} returned {rc}")

    def _local_memory(self, peer_host: str) -> MemoryRegistry:
        with self._engine_lock:
            if self._memory is None:
                name = self._local_host or _local_address_towards(peer_host)
                self._engine = new_engine(name, self._protocol, self._device_name)
                self._memory = MemoryRegistry(self._engine)
            return self._memory


@dataclass(frozen=True)
class Reads:
    """One Mooncake batch: read lengths[i] bytes at remote[i] into local[i]."""

    local: list[int]
    remote: list[int]
    lengths: list[int]


def plan_reads(local: list[tuple[int, int | None]], table: wire.PageTable) -> Reads:
    """Page i of `table` goes to local[i] = (address, start of its registered region or None).

    Rule: a page joins the previous read when it follows it directly in memory on both sides,
    locally within the same registered region and remotely with PAGES_IN_REGIONS set (a page
    registered by itself cannot be read together with its neighbour). Empty pages are skipped.
    """
    reads = Reads([], [], [])
    prev_region = None
    for (dst, region), (src, nbytes) in zip(local, table.pages):
        if not nbytes:
            continue
        if (region is not None and region == prev_region and table.pages_in_regions
                and reads.local[-1] + reads.lengths[-1] == dst
                and reads.remote[-1] + reads.lengths[-1] == src):
            reads.lengths[-1] += nbytes
        else:
            reads.local.append(dst)
            reads.remote.append(src)
            reads.lengths.append(nbytes)
        prev_region = region
    return reads


def _check_table(table: wire.PageTable, views: list[memoryview], request_id: str) -> None:
    """The server's pages must match the destination pages one to one, byte for byte."""
    if len(table.pages) != len(views):
        raise TransferFailed(f"server describes {len(table.pages)} pages of {request_id!r}; "
                             f"the dest has {len(views)}")
    for i, ((_, nbytes), view) in enumerate(zip(table.pages, views)):
        if nbytes != view.nbytes:
            raise TransferFailed(f"page {i} of {request_id!r} is {nbytes} bytes on the server "
                                 f"and {view.nbytes} here: different KV layouts")


def _local_address_towards(host: str) -> str:
    """This machine's address on the route to `host` (a UDP connect sends no packet)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"
