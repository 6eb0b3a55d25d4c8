"""Server half of the "mooncake" KV transport (see `mooncake` for the protocol).

The TCP control server of the "tcp" backend, plus a Mooncake TransferEngine that exposes the
page memory, plus one more request: DESCRIBE_BLOCKS answers where the pages of leased blocks
live, and the client then reads them with the engine, without this process copying a byte.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

from kv_transfer import wire
from kv_transfer.errors import KVTransferError
from kv_transfer.transport.base import HasRegions
from kv_transfer.transport.mooncake_memory import MemoryRegistry, new_engine
from kv_transfer.transport.sockio import Deadline, send_buffers
from kv_transfer.transport.tcp_server import TcpTransferServer
from kv_transfer.wire import MessageType

log = logging.getLogger(__name__)


class MooncakeTransferServer(TcpTransferServer):
    """`host` must be an address clients reach this machine at: it is also the engine's name
    in its handshake, and clients read from the engine at `host:rpc_port`."""

    def __init__(self, host, port, source, on_release, on_stats, *, leases=None, grant_key=None,
                 max_connections: int = 256, hold_s: float = 30.0, protocol: str = "tcp",
                 device_name: str = "", min_bytes_per_s: float = 64 << 20):
        """`hold_s`: how long described pages are kept for the client's read when no release
        comes (at least the client's transfer timeout: a read still running after it has failed),
        grown by their bytes at `min_bytes_per_s` as the client's bound is."""
        super().__init__(host, port, source, self._released(on_release), on_stats, leases=leases,
                         grant_key=grant_key, max_connections=max_connections, min_bytes_per_s=min_bytes_per_s)
        # Pages described to a client, kept until its release (or hold_s): a staged snapshot's
        # buffer goes back to the staging arena when its last view is dropped, and the client
        # reads it after DESCRIBE has returned. In-place pages are views of the cache itself.
        self._hold_s = hold_s
        self._protocol, self._device_name = protocol, device_name
        self._held: dict[str, list[tuple[float, list]]] = {}
        self._held_lock = threading.Lock()
        self._engine = None
        self._memory: MemoryRegistry | None = None
        self.rpc_port = 0

    def start(self) -> None:
        engine = new_engine(self.host, self._protocol, self._device_name)
        memory = MemoryRegistry(engine)
        if isinstance(self.source, HasRegions):
            memory.add_regions(self.source.regions())
        self._engine, self._memory, self.rpc_port = engine, memory, engine.get_rpc_port()
        try:
            super().start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        super().stop()  # no DESCRIBE can run after this
        with self._held_lock:
            self._held.clear()
        if self._memory is not None:
            self._memory.clear()
        self._engine = self._memory = None

    def _dispatch(self, conn, msg_type: MessageType, request_id: str, block_ids: list[int],
                  deadline: Deadline, grant: bytes = b"") -> bool:
        if msg_type != MessageType.DESCRIBE_BLOCKS:
            return super()._dispatch(conn, msg_type, request_id, block_ids, deadline, grant)
        self._drop_expired(time.monotonic())
        # As for READ_BLOCKS: a staged source copies the blocks here, so a lease that ends
        # during the copy must keep them until it is done (its blocks could be reused).
        with self._pinned(request_id):
            pages = self._leased_pages(request_id, block_ids, grant)
        if isinstance(pages, str):
            reply = wire.encode_error(request_id, pages)
        else:
            try:
                placed = [self._memory.ensure(p) for p in pages]  # (address, region or None)
                # One add_regions call merged touching regions, so any adjacent pages here
                # lie in one registered range when all pages lie in regions.
                table = wire.PageTable(
                    self.rpc_port, [(address, p.nbytes) for (address, _), p in zip(placed, pages)],
                    pages_in_regions=all(region is not None for _, region in placed))
                reply = wire.encode_ok(request_id, wire.encode_page_table(table))
                with self._held_lock:
                    hold_s = self._hold_s + sum(p.nbytes for p in pages) / self.min_bytes_per_s
                    self._held.setdefault(request_id, []).append((time.monotonic() + hold_s, pages))
            except (KVTransferError, ValueError, TypeError) as exc:  # registration or encoding
                log.exception("describing blocks %r of %r failed", block_ids, request_id)
                reply = wire.encode_error(request_id, f"cannot describe blocks of {request_id!r}: {exc}")
        send_buffers(conn, [reply], deadline)
        return True

    def _released(self, on_release):
        """on_release, after which the released request's described pages are let go (called
        only for a release whose grant verified: nobody else can end another's read)."""
        # A weak reference: a closure over self is a cycle that kept unstopped servers, and
        # their Mooncake engines' listeners, alive until a garbage collection (measured: a later
        # server's connects waited out a 1 s SYN retry).
        server = weakref.ref(self)

        def released(request_id: str) -> None:
            alive = server()
            if alive is not None:
                with alive._held_lock:
                    alive._held.pop(request_id, None)
                alive._drop_expired(time.monotonic())  # an idle server's leftovers, too
            on_release(request_id)
        return released

    def _drop_expired(self, now_s: float) -> None:
        with self._held_lock:
            for request_id in list(self._held):
                kept = [(until, pages) for until, pages in self._held[request_id] if until > now_s]
                if kept:
                    self._held[request_id] = kept
                else:
                    del self._held[request_id]

    @property
    def held_requests(self) -> int:
        with self._held_lock:
            return len(self._held)
