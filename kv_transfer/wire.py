"""On-the-wire format of the KV transfer TCP protocol (pure: bytes in, records out; no pickle).

Every message is a fixed 20-byte header, then the request id, then the block ids, then the
payload. All integers are unsigned, network byte order (big-endian):

    offset  size  field             type    meaning
    ------  ----  ----------------  ------  ----------------------------------------------
         0     4  magic             bytes   b"MSKV"
         4     1  version           u8      1
         5     1  type              u8      MessageType (READ_BLOCKS=1 ... DESCRIBE_BLOCKS=7)
         6     2  request_id_len    u16     bytes of the utf-8 request id, <= 256
         8     4  block_count       u32     number of block ids, <= 1 << 20
        12     8  payload_len       u64     bytes of payload, <= the receiver's limit
        20     R  request_id        utf-8   R = request_id_len
      20+R   4*B  block_ids         u32[B]  B = block_count
    20+R+4B    P  payload           bytes   P = payload_len

Payloads by type: READ_BLOCKS, RELEASE and DESCRIBE_BLOCKS carry the lease grant the prefill
signed (kv_transfer.grants: 40 bytes; none where the application runs without grants), STATS
none; DATA carries the
pages back to back in the order requested; OK carries nothing, (for STATS) utf-8 JSON, or (for
DESCRIBE_BLOCKS) a page table; ERROR carries a utf-8 message.

A page table tells a reader with one-sided access (the "mooncake" backend) where the pages of
the requested blocks live in the server's memory, layer-major like DATA:

    u16 rpc_port, u16 flags, u32 count, then count x (u64 address, u32 nbytes)   (big-endian)

flags bit 0 (PAGES_IN_REGIONS): every page lies in memory the server registered as a whole
region, so pages that are adjacent in memory may be read as one range. No other bit is defined.
 Receivers call `decode_header` on the first 20 bytes, which validates every
length before anything is allocated or read, so a garbage peer cannot make us read 2**64 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Sequence

from kv_transfer.errors import WireError

MAGIC = b"MSKV"
VERSION = 1
_HEADER = struct.Struct("!4sBBHIQ")
HEADER_SIZE = _HEADER.size  # 20
MAX_REQUEST_ID_BYTES = 256
MAX_BLOCKS = 1 << 20
_MAX_BLOCK_ID = (1 << 32) - 1
MAX_PAGES = 1 << 24  # pages in one page table (layers x blocks)
_PAGE_TABLE_HEAD = struct.Struct("!HHI")  # rpc_port, flags, count
PAGES_IN_REGIONS = 1
_PAGE_ENTRY = struct.Struct("!QI")  # address, nbytes
# ERROR texts are truncated to this, so any receiver can afford to read one.
MAX_ERROR_BYTES = 16 * 1024


class MessageType(IntEnum):
    READ_BLOCKS = 1
    RELEASE = 2
    STATS = 3
    DATA = 4
    OK = 5
    ERROR = 6
    DESCRIBE_BLOCKS = 7


@dataclass(frozen=True)
class Header:
    """A validated message header; the body (request id + block ids) follows it."""

    type: MessageType
    request_id_len_bytes: int
    block_count: int
    payload_len_bytes: int

    @property
    def body_len_bytes(self) -> int:
        """Bytes between the header and the payload: request id, then block ids."""
        return self.request_id_len_bytes + 4 * self.block_count


def _check_request_id(request_id: str) -> bytes:
    raw = request_id.encode("utf-8")
    if len(raw) > MAX_REQUEST_ID_BYTES:
        raise WireError(f"request id is {len(raw)} bytes utf-8; the limit is {MAX_REQUEST_ID_BYTES}")
    return raw


def encode_prefix(msg_type: MessageType, request_id: str = "", block_ids: Sequence[int] = (),
                  payload_len_bytes: int = 0) -> bytes:
    """Header + request id + block ids of a message whose payload the caller sends next.

    Kept separate from the payload so DATA pages go out straight from the KV cache.
    """
    raw_id = _check_request_id(request_id)
    if len(block_ids) > MAX_BLOCKS:
        raise WireError(f"{len(block_ids)} block ids in one message; the limit is {MAX_BLOCKS}")
    if not 0 <= payload_len_bytes < 1 << 64:
        raise WireError(f"payload length {payload_len_bytes} does not fit in u64")
    try:
        ids = struct.pack(f"!{len(block_ids)}I", *block_ids)
    except struct.error as exc:
        raise WireError(f"block ids must be integers in [0, {_MAX_BLOCK_ID}]: {exc}") from None
    header = _HEADER.pack(MAGIC, VERSION, int(msg_type), len(raw_id), len(block_ids),
                          payload_len_bytes)
    return header + raw_id + ids


def encode_read_blocks(request_id: str, block_ids: Sequence[int], grant: bytes = b"") -> bytes:
    return encode_prefix(MessageType.READ_BLOCKS, request_id, block_ids, len(grant)) + grant


def encode_release(request_id: str, block_ids: Sequence[int] = (), grant: bytes = b"") -> bytes:
    return encode_prefix(MessageType.RELEASE, request_id, block_ids, len(grant)) + grant


def encode_stats() -> bytes:
    return encode_prefix(MessageType.STATS)


def encode_describe_blocks(request_id: str, block_ids: Sequence[int], grant: bytes = b"") -> bytes:
    return encode_prefix(MessageType.DESCRIBE_BLOCKS, request_id, block_ids, len(grant)) + grant


def page_table_bytes(count: int) -> int:
    """Size of the page table of `count` pages (a receiver's exact payload limit)."""
    return _PAGE_TABLE_HEAD.size + count * _PAGE_ENTRY.size


@dataclass(frozen=True)
class PageTable:
    """Where the server's pages are: read them from the Mooncake engine at host:rpc_port."""

    rpc_port: int
    pages: list[tuple[int, int]]  # (address, nbytes), layer-major
    pages_in_regions: bool = False  # adjacent pages may be read as one range


def encode_page_table(table: PageTable) -> bytes:
    """The DESCRIBE_BLOCKS answer's payload."""
    if not 0 < table.rpc_port < 1 << 16:
        raise WireError(f"rpc port {table.rpc_port} is not in [1, 65535]")
    if len(table.pages) > MAX_PAGES:
        raise WireError(f"{len(table.pages)} pages in one page table; the limit is {MAX_PAGES}")
    try:
        entries = b"".join(_PAGE_ENTRY.pack(address, nbytes) for address, nbytes in table.pages)
    except struct.error as exc:
        raise WireError(f"page addresses must fit u64 and sizes u32: {exc}") from None
    flags = PAGES_IN_REGIONS if table.pages_in_regions else 0
    return _PAGE_TABLE_HEAD.pack(table.rpc_port, flags, len(table.pages)) + entries


def decode_page_table(payload: bytes | bytearray | memoryview) -> PageTable:
    """The page table in a DESCRIBE_BLOCKS answer; WireError if it is malformed."""
    if len(payload) < _PAGE_TABLE_HEAD.size:
        raise WireError(f"page table of {len(payload)} bytes is shorter than its "
                        f"{_PAGE_TABLE_HEAD.size}-byte head")
    rpc_port, flags, count = _PAGE_TABLE_HEAD.unpack_from(payload)
    if rpc_port == 0:
        raise WireError("page table names rpc port 0")
    if flags & ~PAGES_IN_REGIONS:
        raise WireError(f"page table has unknown flags {flags:#x}")
    if count > MAX_PAGES:
        raise WireError(f"page table of {count} pages exceeds the limit {MAX_PAGES}")
    if len(payload) != page_table_bytes(count):
        raise WireError(f"page table of {count} pages should be {page_table_bytes(count)} bytes, "
                        f"got {len(payload)}")
    pages = list(_PAGE_ENTRY.iter_unpack(memoryview(payload)[_PAGE_TABLE_HEAD.size:]))
    return PageTable(rpc_port, pages, bool(flags & PAGES_IN_REGIONS))


def encode_data_prefix(request_id: str, payload_len_bytes: int) -> bytes:
    """DATA header; the `payload_len_bytes` of pages follow it, sent by the caller."""
    return encode_prefix(MessageType.DATA, request_id, (), payload_len_bytes)


def encode_ok(request_id: str = "", payload: bytes = b"") -> bytes:
    return encode_prefix(MessageType.OK, request_id, (), len(payload)) + payload


def encode_error(request_id: str, message: str) -> bytes:
    text = message.encode("utf-8")[:MAX_ERROR_BYTES]
    return encode_prefix(MessageType.ERROR, request_id, (), len(text)) + text


def decode_header(data: bytes | bytearray | memoryview, max_payload_bytes: int) -> Header:
    """Parse and validate the first HEADER_SIZE bytes of a message.

    `max_payload_bytes` is the receiver's limit for this exchange (e.g. the bytes its
    destination pages hold); a larger declared payload is rejected before any of it is read.
    """
    if len(data) < HEADER_SIZE:
        raise WireError(f"truncated header: {len(data)} of {HEADER_SIZE} bytes")
    magic, version, raw_type, id_len, block_count, payload_len = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}: not a moe-serve KV peer")
    if version != VERSION:
        raise WireError(f"unsupported protocol version {version}; this side speaks {VERSION}")
    try:
        msg_type = MessageType(raw_type)
    except ValueError:
        raise WireError(f"unknown message type {raw_type}") from None
    if id_len > MAX_REQUEST_ID_BYTES:
        raise WireError(f"request id length {id_len} exceeds the limit {MAX_REQUEST_ID_BYTES}")
    if block_count > MAX_BLOCKS:
        raise WireError(f"block count {block_count} exceeds the limit {MAX_BLOCKS}")
    if payload_len > max_payload_bytes:
        raise WireError(f"{msg_type.name} payload of {payload_len} bytes exceeds this receiver's "
                        f"limit of {max_payload_bytes} bytes")
    return Header(msg_type, id_len, block_count, payload_len)


def decode_body(header: Header, body: bytes | bytearray | memoryview) -> tuple[str, tuple[int, ...]]:
    """Request id and block ids from the `header.body_len_bytes` bytes after the header."""
    if len(body) != header.body_len_bytes:
        raise WireError(f"body is {len(body)} bytes; the header declares {header.body_len_bytes}")
    try:
        request_id = bytes(body[:header.request_id_len_bytes]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"request id is not valid utf-8: {exc}") from None
    block_ids = struct.unpack_from(f"!{header.block_count}I", body, header.request_id_len_bytes)
    return request_id, block_ids
