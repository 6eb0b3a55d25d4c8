import struct

import pytest

from kv_transfer import wire
from kv_transfer.errors import WireError
from kv_transfer.wire import HEADER_SIZE, MessageType


def _decode(message: bytes, max_payload_bytes: int = 1 << 20):
    header = wire.decode_header(message[:HEADER_SIZE], max_payload_bytes)
    body_end = HEADER_SIZE + header.body_len_bytes
    request_id, block_ids = wire.decode_body(header, message[HEADER_SIZE:body_end])
    return header, request_id, block_ids, message[body_end:]


def test_header_layout_is_the_documented_one():
    message = wire.encode_read_blocks("r", [1, 2])
    assert HEADER_SIZE == 20
    assert message[:4] == b"MSKV"
    assert message[4] == 1 and message[5] == MessageType.READ_BLOCKS
    assert struct.unpack("!HIQ", message[6:20]) == (1, 2, 0)
    assert message[20:] == b"r" + struct.pack("!II", 1, 2)


def test_read_blocks_round_trip():
    ids = [3, 7, 1, 0, (1 << 32) - 1]
    header, request_id, block_ids, payload = _decode(wire.encode_read_blocks("req-é-1", ids))
    assert header.type == MessageType.READ_BLOCKS
    assert request_id == "req-é-1" and block_ids == tuple(ids) and payload == b""


@pytest.mark.parametrize("message,msg_type,request_id,payload", [
    (wire.encode_release("abc"), MessageType.RELEASE, "abc", b""),
    (wire.encode_stats(), MessageType.STATS, "", b""),
    (wire.encode_ok("abc", b'{"x": 1}'), MessageType.OK, "abc", b'{"x": 1}'),
    (wire.encode_error("abc", "no such blocks"), MessageType.ERROR, "abc", b"no such blocks"),
])
def test_other_messages_round_trip(message, msg_type, request_id, payload):
    header, got_id, block_ids, got_payload = _decode(message)
    assert (header.type, got_id, block_ids, got_payload) == (msg_type, request_id, (), payload)
    assert header.payload_len_bytes == len(payload)


def test_data_prefix_declares_the_payload_that_follows():
    header, request_id, _, rest = _decode(wire.encode_data_prefix("r", 5 * 4096))
    assert header.type == MessageType.DATA and header.payload_len_bytes == 5 * 4096 and rest == b""


def _corrupt(offset: int, fmt: str, value) -> bytes:
    message = bytearray(wire.encode_read_blocks("r", [1]))
    struct.pack_into(fmt, message, offset, value)
    return bytes(message)


@pytest.mark.parametrize("header,problem", [
    (_corrupt(0, "!4s", b"MSKW"), "bad magic"),
    (_corrupt(0, "!4s", b"GET "), "bad magic"),
    (_corrupt(4, "!B", 2), "unsupported protocol version 2"),
    (_corrupt(4, "!B", 0), "unsupported protocol version 0"),
    (_corrupt(5, "!B", 0), "unknown message type 0"),
    (_corrupt(5, "!B", 8), "unknown message type 8"),
    (_corrupt(6, "!H", 257), "request id length 257"),
    (_corrupt(8, "!I", (1 << 20) + 1), "block count 1048577"),
    (_corrupt(8, "!I", (1 << 32) - 1), "block count 4294967295"),
    (_corrupt(12, "!Q", (1 << 64) - 1), "exceeds this receiver's limit"),
    (_corrupt(12, "!Q", 1025), "limit of 1024 bytes"),
])
def test_corrupted_headers_are_rejected_naming_the_problem(header, problem):
    with pytest.raises(WireError, match=problem):
        wire.decode_header(header[:HEADER_SIZE], max_payload_bytes=1024)


def test_payload_exactly_at_the_limit_is_accepted():
    header = wire.decode_header(_corrupt(12, "!Q", 1024)[:HEADER_SIZE], max_payload_bytes=1024)
    assert header.payload_len_bytes == 1024


@pytest.mark.parametrize("n_bytes", [0, 1, 19])
def test_truncated_header_is_rejected(n_bytes):
    with pytest.raises(WireError, match="truncated header"):
        wire.decode_header(wire.encode_stats()[:n_bytes], max_payload_bytes=0)


def test_body_must_match_the_header_and_be_utf8():
    message = wire.encode_read_blocks("r", [1, 2])
    header = wire.decode_header(message[:HEADER_SIZE], 0)
    with pytest.raises(WireError, match="declares 9"):
        wire.decode_body(header, message[HEADER_SIZE:-1])
    bad_id = bytearray(message)
    bad_id[HEADER_SIZE] = 0xFF
    with pytest.raises(WireError, match="utf-8"):
        wire.decode_body(header, bad_id[HEADER_SIZE:])


def test_encoding_refuses_what_the_format_cannot_carry():
    with pytest.raises(WireError, match="257 bytes"):
        wire.encode_release("x" * 257)
    wire.encode_release("x" * 256)
    with pytest.raises(WireError, match="block ids"):
        wire.encode_read_blocks("r", [1 << 32])
    with pytest.raises(WireError, match="block ids"):
        wire.encode_read_blocks("r", [-1])


def test_error_text_is_truncated_to_the_limit():
    header, _, _, payload = _decode(wire.encode_error("r", "e" * 100_000))
    assert header.payload_len_bytes == len(payload) == wire.MAX_ERROR_BYTES


def test_describe_blocks_round_trip():
    header, request_id, block_ids, payload = _decode(wire.encode_describe_blocks("abc", [4, 2]))
    assert (header.type, request_id, block_ids, payload) == (MessageType.DESCRIBE_BLOCKS, "abc", (4, 2), b"")


def test_page_table_round_trip_and_validation():
    pages = [(0x7F00_0000_1000, 4096), ((1 << 64) - 1, (1 << 32) - 1), (0, 0)]
    for in_regions in (False, True):
        table = wire.PageTable(4242, pages, in_regions)
        payload = wire.encode_page_table(table)
        assert len(payload) == wire.page_table_bytes(3) == 8 + 3 * 12
        assert wire.decode_page_table(payload) == table
    assert payload[:8] == struct.pack("!HHI", 4242, 1, 3)
    with pytest.raises(WireError, match="should be"):
        wire.decode_page_table(payload[:-1])
    with pytest.raises(WireError, match="rpc port 0"):
        wire.decode_page_table(b"\0" * 8)
    with pytest.raises(WireError, match="unknown flags 0x2"):
        wire.decode_page_table(struct.pack("!HHI", 1, 2, 0))
    with pytest.raises(WireError, match="shorter"):
        wire.decode_page_table(b"\0\0")
    with pytest.raises(WireError):
        wire.encode_page_table(wire.PageTable(1, [(1 << 64, 1)]))
    with pytest.raises(WireError, match="rpc port 70000"):
        wire.encode_page_table(wire.PageTable(70000, []))
