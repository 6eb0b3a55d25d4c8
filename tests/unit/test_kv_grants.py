"""Signed lease grants (kv_transfer/grants.py) and the transfer server that checks them: a read
or release without a valid grant is refused, a replay after the deadline is refused even when
the server no longer remembers the lease, and a grant made with another secret never verifies."""

import time

import pytest

from kv_transfer.errors import TransferFailed
from kv_transfer.grants import PAYLOAD_BYTES, GrantKey
from kv_transfer.transport import get_backend
from tests.unit.test_kv_tcp_transport import BytePages, _same

SECRET = "ab" * 32
OTHER = "cd" * 32


def _now_ms() -> int:
    return int(time.time() * 1000)


def test_a_grant_verifies_only_for_its_request_secret_and_lifetime():
    key = GrantKey(SECRET)
    grant = key.payload("req-1", 2_000)
    assert len(grant) == PAYLOAD_BYTES
    assert key.check("req-1", grant, 1_999) is None
    assert "expired" in key.check("req-1", grant, 2_000)
    assert key.check("req-1", grant, None) is None  # releases: the MAC alone
    assert "does not verify" in key.check("req-2", grant, 1_000)
    assert "does not verify" in GrantKey(OTHER).check("req-1", grant, 1_000)
    forged_deadline = grant[:32] + (10 ** 12).to_bytes(8, "big")  # extending a lease breaks the MAC
    assert "does not verify" in key.check("req-1", forged_deadline, 1_000)
    assert "no lease grant" in key.check("req-1", b"", 1_000)


def test_a_weak_or_malformed_secret_is_refused():
    with pytest.raises(ValueError, match="16 bytes"):
        GrantKey("ab" * 8 + "a")  # odd hex
    with pytest.raises(ValueError, match="16 bytes"):
        GrantKey("ab" * 15)


@pytest.fixture
def granted_server():
    source = BytePages(seed=11)
    released = []
    server = get_backend("tcp").server("127.0.0.1", 0, source, on_release=released.append,
                                       on_stats=lambda: {}, grant_key=GrantKey(SECRET))
    server.start()
    client = get_backend("tcp").client()
    yield server, client, source, released
    client.close()
    server.stop()


def _read(client, server, request_id, blocks, grant):
    sink = BytePages()
    host, port = server.address
    client.fetch(host, port, request_id, blocks, sink.pages(blocks), 5.0, grant)
    return sink


def test_reads_need_a_live_grant_for_their_request(granted_server):
    server, client, source, _ = granted_server
    key = GrantKey(SECRET)
    sink = _read(client, server, "req-1", [1, 2], key.payload("req-1", _now_ms() + 10_000))
    assert _same(source, sink, [1, 2])
    cases = {
        "no grant": b"",
        "another request's grant": key.payload("req-2", _now_ms() + 10_000),
        "a grant signed with another secret": GrantKey(OTHER).payload("req-1", _now_ms() + 10_000),
        "an expired grant (a replay)": key.payload("req-1", _now_ms() - 1),
    }
    for name, grant in cases.items():
        with pytest.raises(TransferFailed, match="refused"):
            _read(client, server, "req-1", [1, 2], grant)
    assert server.refused_requests == len(cases)
    assert _read(client, server, "req-3", [0], key.payload("req-3", _now_ms() + 10_000))  # still serving


def test_releases_need_the_grant_too(granted_server):
    server, client, _, released = granted_server
    host, port = server.address
    with pytest.raises(TransferFailed, match="refused"):
        client.release(host, port, "req-1", 5.0, (1,), b"")
    with pytest.raises(TransferFailed, match="refused"):
        client.release(host, port, "req-1", 5.0, (1,), GrantKey(OTHER).payload("req-1", _now_ms() + 10_000))
    assert released == []
    client.release(host, port, "req-1", 5.0, (1,), GrantKey(SECRET).payload("req-1", _now_ms() - 1))
    assert released == ["req-1"]  # late is fine: the lease has ended anyway


def test_an_oversized_grant_payload_is_a_framing_error(granted_server):
    import socket

    from kv_transfer import wire

    server, *_ = granted_server
    with socket.create_connection(server.address, timeout=5) as sock:
        sock.sendall(wire.encode_read_blocks("req-1", [1], b"x" * (PAYLOAD_BYTES + 1)))
        reply = sock.recv(4096)
    assert b"bad message" in reply
