"""Server half of the "tcp" KV transport: one thread per connection (see `tcp` for the protocol)."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time

from kv_transfer import grants, wire
from kv_transfer.errors import KVTransferError, WireError
from kv_transfer.host_staging import StagingExhausted
from kv_transfer.transport.base import TransferServer
from kv_transfer.transport.sockio import (Deadline, byte_view, read_message_start, recv_exact,
                                          send_buffers, tune_socket)
from kv_transfer.wire import MessageType

log = logging.getLogger(__name__)


class TcpTransferServer(TransferServer):
    """`io_timeout_s` bounds each message once started (a stalled client is dropped);
    `idle_timeout_s` closes a connection no request arrives on (the client's pool reconnects);
    at most `max_connections` are served at once (one thread each), so a flood of sockets cannot
    exhaust threads or descriptors. At the cap, the connection idle longest is closed to make
    room (a client's pool reconnects on its next request); only when every connection is busy
    mid-message is a new one refused. So idle sockets, an attacker's included, never lock out
    real pulls and releases."""

    io_timeout_s = 30.0
    idle_timeout_s = 60.0
    accept_retry_s = 0.5  # after an accept() error such as running out of descriptors

    def __init__(self, host, port, source, on_release, on_stats, *, leases=None, grant_key=None,
                 max_connections: int = 256, min_bytes_per_s: float = 64 << 20):
        """`min_bytes_per_s`: the slowest send of blocks allowed; a reply of N bytes gets
        io_timeout_s + N / min_bytes_per_s (a 32k-token prompt's KV is hundreds of MiB)."""
        super().__init__(host, port, source, on_release, on_stats, leases=leases, grant_key=grant_key)
        self.max_connections = max_connections
        self.min_bytes_per_s = min_bytes_per_s
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._idle_since: dict[socket.socket, float] = {}  # connections waiting for their next request
        self._threads: list[threading.Thread] = []
        self._acceptor: threading.Thread | None = None
        self.accept_errors = 0
        self.refused_connections = 0  # every connection busy at the cap
        self.evicted_connections = 0  # idle ones closed at the cap to make room
        self.refused_requests = 0  # reads and releases without a valid grant

    def counters(self) -> dict[str, int]:
        """The server's own counters, for the engine's stats export."""
        return {"server_refused_connections_total": self.refused_connections,
                "server_evicted_connections_total": self.evicted_connections,
                "server_refused_requests_total": self.refused_requests,
                "server_accept_errors_total": self.accept_errors}

    @property
    def address(self) -> tuple[str, int]:
        if self._listener is None:
            raise RuntimeError("server not started")
        host, port = self._listener.getsockname()[:2]
        return host, port

    def start(self) -> None:
        listener = socket.create_server((self.host, self.port), backlog=128)
        listener.settimeout(0.2)  # accept() wakes up to notice stop()
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)
        self._acceptor.start()

    def stop(self) -> None:
        self._stopping.set()
        # Acceptor first, so no connection can arrive after we shut the open ones down.
        if self._acceptor is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() now (Linux)
            except OSError:
                pass
            self._acceptor.join()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes a recv blocked in its thread
            except OSError:
                pass
        for thread in threads:
            thread.join(timeout=2.0)
        if self._listener is not None:
            self._listener.close()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping.is_set():
                    return  # listener closed by stop()
                # EMFILE, ENOBUFS, ECONNABORTED...: transient. Ending here would leave every later
                # pull from this engine failing; keep accepting once the pressure eases.
                self.accept_errors += 1
                log.warning("KV transfer server %s:%s: accept failed (%s); retrying", self.host, self.port, exc)
                self._stopping.wait(self.accept_retry_s)
                continue
            if not self._make_room():
                self.refused_connections += 1
                self._refuse(conn)
                continue
            tune_socket(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                      name=f"kv-tcp-conn-{peer[0]}:{peer[1]}")
            with self._lock:
                self._conns.add(conn)
                self._threads.append(thread)
            try:
                thread.start()
            except RuntimeError as exc:  # "can't start new thread": refuse this one, keep accepting
                self.accept_errors += 1
                log.warning("KV transfer server %s:%s: no thread for a connection (%s)", self.host, self.port, exc)
                with self._lock:
                    self._conns.discard(conn)
                    self._threads.remove(thread)
                self._refuse(conn)

    def _make_room(self) -> bool:
        """Below the cap, or at it with an idle connection closed to make room."""
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            if len(self._threads) < self.max_connections:
                return True
            if not self._idle_since:
                return False
            oldest = min(self._idle_since, key=self._idle_since.__getitem__)
            del self._idle_since[oldest]
        self.evicted_connections += 1
        try:
            oldest.shutdown(socket.SHUT_RDWR)  # its thread sees EOF in its idle wait and ends
        except OSError:
            pass
        # Its thread is ending; count its slot as free now rather than wait for the join.
        return True

    def _refuse(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(1.0)
            conn.sendall(wire.encode_error("", f"server busy: {self.max_connections} connections open"))
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._stopping.is_set():
                # A pooled connection may idle between requests: wait up to idle_timeout_s for the
                # next one to begin, then give the whole exchange io_timeout_s.
                conn.settimeout(self.idle_timeout_s)
                with self._lock:
                    self._idle_since[conn] = time.monotonic()
                try:
                    if not conn.recv(1, socket.MSG_PEEK):
                        return
                except TimeoutError:
                    return  # idle too long: the client's pool reconnects on its next request
                finally:
                    with self._lock:
                        evicted = self._idle_since.pop(conn, None) is None
                if evicted:
                    return  # closed at the cap while idle
                deadline = Deadline(self.io_timeout_s)
                try:
                    # Requests carry at most a lease grant; a longer payload is a framing error.
                    # No message names more blocks than this engine has: the ids are decoded
                    # only after that bound is checked, so no client can make the server decode
                    # more than one engine's worth of block ids per message.
                    message = read_message_start(conn, deadline, grants.PAYLOAD_BYTES,
                                                 getattr(self.source, "num_blocks", None))
                except WireError as exc:
                    # The stream is out of step with the framing; nothing after this is trustworthy.
                    send_buffers(conn, [wire.encode_error("", f"bad message: {exc}")], deadline)
                    return
                if message is None:
                    return
                header, request_id, block_ids = message
                grant = bytes(recv_exact(conn, header.payload_len_bytes, deadline)) if header.payload_len_bytes else b""
                if not self._dispatch(conn, header.type, request_id, list(block_ids), deadline, grant):
                    return
        except (OSError, KVTransferError) as exc:
            log.debug("KV transfer connection dropped: %s", exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._idle_since.pop(conn, None)
            conn.close()

    def _dispatch(self, conn, msg_type: MessageType, request_id: str, block_ids: list[int],
                  deadline: Deadline, grant: bytes = b"") -> bool:
        """Answer one request; False closes the connection."""
        def error(text: str) -> bool:
            send_buffers(conn, [wire.encode_error(request_id, text)], deadline)
            return True

        if msg_type == MessageType.READ_BLOCKS:
            # Pinned before the lease is checked: a lease ending after the check keeps its pages
            # until they are sent; one that ended before it is refused by the check.
            with self._pinned(request_id):
                pages = self._leased_pages(request_id, block_ids, grant)
                if isinstance(pages, str):
                    return error(pages)
                nbytes = sum(p.nbytes for p in pages)
                prefix = wire.encode_data_prefix(request_id, nbytes)
                send_buffers(conn, [prefix, *pages], Deadline(self.io_timeout_s + nbytes / self.min_bytes_per_s))
            return True
        if msg_type == MessageType.RELEASE:
            # The release names the lease's whole block list, which its grant covers; a late
            # release is harmless, so an expired grant may still release.
            refused = self._refused(request_id, block_ids, grant, live=False)
            if refused:
                self.refused_requests += 1
                return error(f"release of {request_id!r} refused: {refused}")
            try:
                self.on_release(request_id)
            except Exception as exc:  # the callback's failure is the client's answer
                log.exception("on_release(%r) failed", request_id)
                return error(f"release of {request_id!r} failed: {exc!r}")
            send_buffers(conn, [wire.encode_ok(request_id)], deadline)
            return True
        if msg_type == MessageType.STATS:
            try:
                payload = json.dumps(self.on_stats()).encode("utf-8")
            except Exception as exc:
                log.exception("on_stats() failed")
                return error(f"stats failed: {exc!r}")
            send_buffers(conn, [wire.encode_ok(request_id, payload)], deadline)
            return True
        error(f"{msg_type.name} is not a request this server answers")
        return False

    def _refused(self, request_id: str, lease_block_ids, grant: bytes, *, live: bool = True) -> str | None:
        """Why this grant does not open the lease of `request_id` over `lease_block_ids` on
        this engine (None: it does). An engine without grants lends nothing."""
        if self.grant_key is None:
            return "this engine lends no KV"
        return self.grant_key.check(request_id, lease_block_ids, grant, int(time.time() * 1000) if live else None)

    def _pinned(self, request_id: str):
        """While pages of `request_id` are read out of the source: its lease's blocks stay
        (the lease lookup's `sending`, where it has one)."""
        sending = getattr(self.leases, "sending", None)
        return sending(request_id) if sending is not None else contextlib.nullcontext()

    def _leased_pages(self, request_id: str, block_ids: list[int], grant: bytes = b""
                      ) -> list[memoryview] | str:
        """The pages of `block_ids` as flat byte views, or why they may not be served. Served
        only under a lease this engine knows and a live grant of exactly that lease."""
        if self.grant_key is None or self.leases is None:
            self.refused_requests += 1
            return f"read of {request_id!r} refused: this engine lends no KV"
        if len(set(block_ids)) != len(block_ids):
            return f"read of {request_id!r} names a block more than once"
        if not grants.live_deadline(grant, int(time.time() * 1000)):
            self.refused_requests += 1  # before any wait for the lease: nothing to wait for
            return f"read of {request_id!r} refused: no live lease grant with the request"
        lease = self.leases.get(request_id)
        if lease is None:
            self.refused_requests += 1
            return (f"read of {request_id!r} refused: request {request_id!r} holds no KV lease here "
                    "(released, expired or never granted)")
        refused = self._refused(request_id, lease.block_ids, grant)
        if refused:
            self.refused_requests += 1
            return f"read of {request_id!r} refused: {refused}"
        if not lease.covers(block_ids):
            self.refused_requests += 1
            return f"blocks {block_ids} are not all leased to request {request_id!r}"
        try:
            return [byte_view(p) for p in self.source.pages(block_ids)]
        except (KeyError, ValueError, IndexError, StagingExhausted) as exc:
            return f"cannot serve blocks {block_ids} of {request_id!r}: {exc!r}"
        except Exception as exc:
            log.exception("source.pages(%r) failed", block_ids)
            return f"internal error reading blocks of {request_id!r}: {exc!r}"
