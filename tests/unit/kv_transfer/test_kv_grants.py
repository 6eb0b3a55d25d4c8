"""Signed lease grants (kv_transfer/grants.py) and the transfer server that checks them: a read
or release without a valid grant is refused, a replay after the deadline is refused even when
the server no longer remembers the lease, a grant made with another secret never verifies, and
a grant opens only the scope it was signed for (engine, address, request, the lease's blocks)."""

import time
from dataclasses import replace

import pytest

from kv_transfer.errors import TransferFailed
from kv_transfer.grants import PAYLOAD_BYTES, EngineGrants, GrantKey, GrantScope
from kv_transfer.transport import get_backend
from tests.unit.kv_grant_fakes import SECRET, EveryBlockLeased, engine_grants, grant_for
from tests.unit.kv_transfer.test_kv_tcp_transport import BLOCKS, BytePages, _same

OTHER = "cd" * 32
SCOPE = GrantScope("prefill-0", "10.0.0.7", 47001, "req-1", (3, 4, 5))


def _now_ms() -> int:
    return int(time.time() * 1000)


def test_a_grant_verifies_only_for_its_scope_secret_and_lifetime():
    key = GrantKey(SECRET)
    grant = key.payload(SCOPE, 2_000)
    assert len(grant) == PAYLOAD_BYTES
    assert key.check(SCOPE, grant, 1_999) is None
    assert "expired" in key.check(SCOPE, grant, 2_000)
    assert key.check(SCOPE, grant, None) is None  # releases: the MAC alone
    assert "does not verify" in GrantKey(OTHER).check(SCOPE, grant, 1_000)
    forged_deadline = grant[:32] + (10 ** 12).to_bytes(8, "big")  # extending a lease breaks the MAC
    assert "does not verify" in key.check(SCOPE, forged_deadline, 1_000)
    assert "no lease grant" in key.check(SCOPE, b"", 1_000)
    elsewhere = {
        "another request": replace(SCOPE, request_id="req-2"),
        "another engine": replace(SCOPE, engine_id="prefill-1"),
        "another host": replace(SCOPE, host="10.0.0.8"),
        "another port": replace(SCOPE, port=47002),
        "a block more": replace(SCOPE, block_ids=(3, 4, 5, 6)),
        "a block less": replace(SCOPE, block_ids=(3, 4)),
        "another block": replace(SCOPE, block_ids=(3, 4, 9)),
    }
    for name, scope in elsewhere.items():
        assert "does not verify" in (key.check(scope, grant, 1_000) or ""), name


def test_no_two_scopes_sign_the_same_bytes():
    # Fields are length-prefixed: moving characters between neighbouring fields changes the message.
    a = GrantScope("ab", "c", 1, "r", (1,))
    b = GrantScope("a", "bc", 1, "r", (1,))
    c = GrantScope("a", "b", 1, "cr", (1,))
    assert len({a.message(5), b.message(5), c.message(5)}) == 3
    assert GrantScope("e", "h", 1, "r", (1, 2)).message(5) != GrantScope("e", "h", 1, "r", (1,)).message(5)


def test_an_engine_checks_grants_against_its_own_identity():
    key = GrantKey(SECRET)
    grant = key.payload(SCOPE, _now_ms() + 10_000)
    own = EngineGrants(key, "prefill-0", "10.0.0.7", 47001)
    assert own.check("req-1", (3, 4, 5), grant, _now_ms()) is None
    assert "does not verify" in own.check("req-1", (3, 4), grant, _now_ms())
    assert "does not verify" in EngineGrants(key, "prefill-1", "10.0.0.7", 47001).check("req-1", (3, 4, 5), grant,
                                                                                        _now_ms())


def test_a_weak_or_malformed_secret_is_refused():
    with pytest.raises(ValueError, match="16 bytes"):
        GrantKey("ab" * 8 + "a")  # odd hex
    with pytest.raises(ValueError, match="16 bytes"):
        GrantKey("ab" * 15)


@pytest.fixture
def granted_server():
    source = BytePages(seed=11)
    released = []
    server = get_backend("tcp").server("127.0.0.1", 0, source, on_release=released.append, on_stats=lambda: {},
                                       leases=EveryBlockLeased(BLOCKS), grant_key=engine_grants())
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


LEASE = range(BLOCKS)  # what every request holds on the granted server


def test_reads_need_a_live_grant_for_their_lease(granted_server):
    server, client, source, _ = granted_server
    sink = _read(client, server, "req-1", [1, 2], grant_for("req-1", LEASE))
    assert _same(source, sink, [1, 2])
    cases = {
        "no grant": b"",
        "another request's grant": grant_for("req-2", LEASE),
        "a grant signed with another secret": grant_for("req-1", LEASE, secret=OTHER),
        "an expired grant (a replay)": grant_for("req-1", LEASE, lease_s=-0.001),
        "another engine's grant": grant_for("req-1", LEASE, engine_id="prefill-1"),
        "a grant for another address": grant_for("req-1", LEASE, port=47001),
        "a grant of only the blocks read": grant_for("req-1", [1, 2]),
    }
    for name, grant in cases.items():
        with pytest.raises(TransferFailed, match="refused"):
            _read(client, server, "req-1", [1, 2], grant)
    assert server.refused_requests == len(cases)
    assert _read(client, server, "req-3", [0], grant_for("req-3", LEASE))  # still serving


def test_releases_need_the_grant_too(granted_server):
    server, client, _, released = granted_server
    host, port = server.address
    with pytest.raises(TransferFailed, match="refused"):
        client.release(host, port, "req-1", 5.0, (1,), b"")
    with pytest.raises(TransferFailed, match="refused"):
        client.release(host, port, "req-1", 5.0, (1,), grant_for("req-1", (1,), secret=OTHER))
    with pytest.raises(TransferFailed, match="refused"):  # the grant of (1, 2) does not release (1,)
        client.release(host, port, "req-1", 5.0, (1,), grant_for("req-1", (1, 2)))
    with pytest.raises(TransferFailed, match="refused"):
        client.release(host, port, "req-1", 5.0, (1,), grant_for("req-1", (1,), engine_id="prefill-1"))
    assert released == []
    client.release(host, port, "req-1", 5.0, (1,), grant_for("req-1", (1,), lease_s=-0.001))
    assert released == ["req-1"]  # late is fine: the lease has ended anyway


def test_an_oversized_grant_payload_is_a_framing_error(granted_server):
    import socket

    from kv_transfer import wire

    server, *_ = granted_server
    with socket.create_connection(server.address, timeout=5) as sock:
        sock.sendall(wire.encode_read_blocks("req-1", [1], b"x" * (PAYLOAD_BYTES + 1)))
        reply = sock.recv(4096)
    assert b"bad message" in reply
