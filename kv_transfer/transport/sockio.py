"""Socket helpers with a deadline: message framing, exact reads, scatter reads into pages,
gather writes.

Every blocking call gets the time left until the deadline as its socket timeout, so a whole
exchange (not each syscall) is bounded by the caller's `timeout_s`.
"""

from __future__ import annotations

import os
import socket
import time

from kv_transfer import wire
from kv_transfer.errors import TransferFailed, TransferTimeout, WireError

# sendmsg/recvmsg_into take at most IOV_MAX buffers per call (1024 on Linux).
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# Socket buffers: None keeps Linux autotuning (loopback measured fastest with it; an
# explicit SO_RCVBUF turns autotuning off and caps the window at net.core.rmem_max).
SOCKET_BUFFER_BYTES: int | None = None


class Deadline:
    """A point in monotonic time that socket operations must finish by."""

    def __init__(self, timeout_s: float | None):
        self.timeout_s = timeout_s
        self._at_s = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining_s(self) -> float | None:
        """Seconds left (None = no deadline); TransferTimeout once it has passed."""
        if self._at_s is None:
            return None
        left_s = self._at_s - time.monotonic()
        if left_s <= 0:
            raise TransferTimeout(f"deadline of {self.timeout_s} s passed", self.timeout_s)
        return left_s

    def arm(self, sock: socket.socket) -> None:
        sock.settimeout(self.remaining_s())


def byte_view(page: memoryview) -> memoryview:
    """The page as a flat unsigned-byte view (no copy); fails for non-contiguous pages."""
    if page.format == "B" and page.ndim == 1:
        return page
    if not page.c_contiguous:
        raise ValueError("KV pages must be C-contiguous to go on the wire without a copy")
    return page.cast("B")



def dest_views(dest_pages, remote_block_ids) -> list[memoryview]:
    """Writable byte views of a fetch's destination pages (a whole number of layers' worth)."""
    if remote_block_ids and len(dest_pages) % len(remote_block_ids):
        raise ValueError(f"{len(dest_pages)} dest pages is not a whole number of layers "
                         f"of {len(remote_block_ids)} blocks")
    views = [byte_view(p) for p in dest_pages]
    if any(v.readonly for v in views):
        raise ValueError("dest pages must be writable")
    return views

def recv_exact(sock: socket.socket, n_bytes: int, deadline: Deadline) -> bytearray:
    """Exactly `n_bytes`; TransferFailed if the peer closes first."""
    buf = bytearray(n_bytes)
    view = memoryview(buf)
    got = 0
    while got < n_bytes:
        deadline.arm(sock)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransferFailed(f"connection closed by peer after {got} of {n_bytes} bytes")
        got += n
    return buf


def recv_into_pages(sock: socket.socket, pages: list[memoryview], deadline: Deadline) -> int:
    """Fill `pages` (flat byte views) in order straight from the socket; returns bytes read.

    One recvmsg_into scatters into up to IOV_MAX pages per syscall, so 32 KiB pages cost
    no more syscalls than one big buffer would.
    """
    pending = [p for p in pages if p.nbytes]
    total = sum(p.nbytes for p in pending)
    got, first = 0, 0
    while first < len(pending):
        deadline.arm(sock)
        n, _, _, _ = sock.recvmsg_into(pending[first:first + _IOV_MAX])
        if n == 0:
            raise TransferFailed(f"connection closed by peer after {got} of {total} payload bytes")
        got += n
        first = _advance(pending, first, n)
    return got


def send_buffers(sock: socket.socket, buffers: list[memoryview | bytes], deadline: Deadline) -> None:
    """Send `buffers` back to back with gathered writes (sendmsg, up to IOV_MAX per call)."""
    pending = [memoryview(b) if isinstance(b, bytes) else b for b in buffers]
    pending = [b for b in pending if b.nbytes]
    first = 0
    while first < len(pending):
        deadline.arm(sock)
        first = _advance(pending, first, sock.sendmsg(pending[first:first + _IOV_MAX]))


def _advance(views: list[memoryview], first: int, n: int) -> int:
    """Consume `n` bytes from views[first:]; returns the new first unfinished view.

    Index-based (a partly done view is replaced by its rest in place) so a 256 MiB payload of
    8192 pages costs O(IOV_MAX) per syscall, not a copy of the whole remaining list.
    """
    while n and n >= views[first].nbytes:
        n -= views[first].nbytes
        first += 1
    if n:
        views[first] = views[first][n:]
    return first


def tune_socket(sock: socket.socket) -> None:
    """TCP_NODELAY, plus explicit buffer sizes when SOCKET_BUFFER_BYTES is set."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small requests go out now
    if SOCKET_BUFFER_BYTES:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)


def read_message_start(sock: socket.socket, deadline: Deadline, max_payload_bytes: int,
                       max_block_count: int | None = None) -> tuple[wire.Header, str, tuple[int, ...]] | None:
    """Header and body of the next message; None if the peer closed cleanly before it.

    The header is validated before the body is read, so no length from the peer is trusted;
    `max_block_count` bounds the block ids one message may name.
    """
    buf = bytearray(wire.HEADER_SIZE)
    deadline.arm(sock)
    n = sock.recv_into(buf)
    if n == 0:
        return None
    if n < wire.HEADER_SIZE:
        buf[n:] = recv_exact(sock, wire.HEADER_SIZE - n, deadline)
    header = wire.decode_header(buf, max_payload_bytes)
    if max_block_count is not None and header.block_count > max_block_count:
        raise WireError(f"message names {header.block_count} blocks; this engine has {max_block_count}")
    request_id, block_ids = wire.decode_body(header, recv_exact(sock, header.body_len_bytes, deadline))
    return header, request_id, block_ids
