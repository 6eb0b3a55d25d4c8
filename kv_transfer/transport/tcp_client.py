"""Client half of the "tcp" KV transport: pooled connections, deadlines, receive into pages."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Callable, TypeVar

from kv_transfer import wire
from kv_transfer.errors import TransferFailed, TransferTimeout, WireError
from kv_transfer.peer_health import PeerUnreachable
from kv_transfer.transport.base import FetchResult, TransferClient
from kv_transfer.transport.sockio import (Deadline, dest_views, read_message_start,
                                          recv_exact, recv_into_pages, send_buffers, tune_socket)
from kv_transfer.wire import MessageType

_T = TypeVar("_T")
_MAX_STATS_BYTES = 16 * 1024 * 1024


class TcpTransferClient(TransferClient):
    """Keeps up to `max_idle_per_peer` idle connections per (host, port) for reuse."""

    def __init__(self, *, max_idle_per_peer: int = 4):
        self.max_idle_per_peer = max_idle_per_peer
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}

    def fetch(self, host, port, request_id, remote_block_ids, dest_pages, timeout_s, grant=b"") -> FetchResult:
        views = dest_views(dest_pages, remote_block_ids)
        expected = sum(v.nbytes for v in views)

        def receive(sock: socket.socket, deadline: Deadline) -> int:
            header = self._reply(sock, deadline, request_id, MessageType.DATA, expected)
            if header.payload_len_bytes != expected:
                raise TransferFailed(f"server is sending {header.payload_len_bytes} bytes for "
                                     f"{request_id!r}; the dest pages hold {expected}")
            return recv_into_pages(sock, views, deadline)

        started_s = time.perf_counter()
        request = wire.encode_read_blocks(request_id, remote_block_ids, grant)
        received = self._exchange(host, port, timeout_s, request, receive)
        return FetchResult(received, time.perf_counter() - started_s)

    def release(self, host, port, request_id, timeout_s, block_ids=(), grant=b"") -> None:
        def ok(sock: socket.socket, deadline: Deadline) -> None:
            self._reply(sock, deadline, request_id, MessageType.OK, 0)
        self._exchange(host, port, timeout_s, wire.encode_release(request_id, block_ids, grant), ok)

    def stats(self, host, port, timeout_s) -> dict:
        def read(sock: socket.socket, deadline: Deadline) -> dict:
            header = self._reply(sock, deadline, "", MessageType.OK, _MAX_STATS_BYTES)
            return json.loads(recv_exact(sock, header.payload_len_bytes, deadline))
        return self._exchange(host, port, timeout_s, wire.encode_stats(), read)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close()

    def _reply(self, sock, deadline, request_id, expected_type, max_payload_bytes) -> wire.Header:
        """Header of the reply; raises TransferFailed(remote=True) with the text of an ERROR."""
        try:
            message = read_message_start(sock, deadline, max(max_payload_bytes, wire.MAX_ERROR_BYTES))
        except ConnectionResetError as exc:
            raise _Stale(str(exc)) from None
        except (TimeoutError, TransferTimeout):
            # Not one byte of a reply before the deadline: the node is gone or blackholed (a
            # live server answers at once, if only with an ERROR). Pulls then skip it a while.
            raise NoReply(f"no reply to {request_id!r} within {deadline.timeout_s} s",
                          deadline.timeout_s) from None
        if message is None:
            raise _Stale("connection closed before the reply")
        header, reply_id, _ = message
        if reply_id != request_id:
            raise TransferFailed(f"reply is for request {reply_id!r}, expected {request_id!r}")
        if header.type == MessageType.ERROR:
            text = recv_exact(sock, header.payload_len_bytes, deadline).decode("utf-8", "replace")
            raise TransferFailed(f"server error: {text}", remote=True)
        if header.type != expected_type:
            raise TransferFailed(f"expected {expected_type.name}, got {header.type.name}")
        if header.type == MessageType.OK and header.payload_len_bytes > max_payload_bytes:
            raise TransferFailed(f"OK reply carries {header.payload_len_bytes} unexpected bytes")
        return header

    def _exchange(self, host: str, port: int, timeout_s: float, request: bytes,
                  handle: Callable[[socket.socket, Deadline], _T]) -> _T:
        """Send `request` on a pooled connection and let `handle` read the reply.

        A pooled connection the server has since closed fails before any reply byte; that
        case is retried once on a fresh connection (every request here is idempotent).
        """
        peer = (host, port)
        deadline = Deadline(timeout_s)
        for attempt in range(2):
            sock, reused = self._checkout(peer, deadline)
            try:
                try:
                    send_buffers(sock, [request], deadline)
                except (BrokenPipeError, ConnectionResetError) as exc:
                    raise _Stale(str(exc)) from None
                result = handle(sock, deadline)
            except _Stale as exc:
                sock.close()
                if reused and attempt == 0:
                    continue
                raise TransferFailed(f"{host}:{port}: {exc}") from None
            except TransferFailed as exc:
                if exc.remote:  # a well-formed ERROR reply: the connection is still in step
                    self._checkin(peer, sock)
                else:
                    sock.close()
                raise
            except TransferTimeout:
                sock.close()
                raise
            except TimeoutError:
                sock.close()
                raise TransferTimeout(f"{host}:{port} did not answer within {timeout_s} s",
                                      timeout_s) from None
            except (OSError, WireError, ValueError) as exc:  # ValueError: bad JSON / utf-8
                sock.close()
                raise TransferFailed(f"{host}:{port}: {exc}") from exc
            except BaseException:
                sock.close()
                raise
            self._checkin(peer, sock)
            return result
        raise AssertionError("unreachable")

    def _checkout(self, peer: tuple[str, int], deadline: Deadline) -> tuple[socket.socket, bool]:
        with self._lock:
            idle = self._idle.get(peer)
            if idle:
                return idle.pop(), True
        try:
            sock = socket.create_connection(peer, timeout=deadline.remaining_s())
        except TimeoutError:
            raise ConnectTimeout(f"connecting to {peer[0]}:{peer[1]} timed out",
                                 deadline.timeout_s) from None
        except OSError as exc:  # refused, no route: instant, or seconds for an unreachable host
            raise ConnectFailed(f"cannot connect to {peer[0]}:{peer[1]}: {exc}") from None
        tune_socket(sock)
        return sock, False

    def _checkin(self, peer: tuple[str, int], sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(peer, [])
            if len(idle) < self.max_idle_per_peer:
                idle.append(sock)
                return
        sock.close()


class ConnectTimeout(TransferTimeout, PeerUnreachable):
    """The connection was not established within the deadline."""


class ConnectFailed(TransferFailed, PeerUnreachable):
    """The connection could not be made (refused, no route to the host)."""


class NoReply(TransferTimeout, PeerUnreachable):
    """Connected, request sent, and not one byte of reply before the deadline."""


class _Stale(Exception):
    """A connection closed before any reply: retried once when it came from the pool."""
