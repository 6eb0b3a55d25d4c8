"""The "tcp" KV transport on real loopback sockets, with bytearray-backed pages.

These tests are about moving bytes: servers check grants against a lease table in which every
request holds every block, and the client presents a grant of that lease (kv_grant_fakes).
Who may read what is tested in test_kv_grants.py and test_kv_port_security.py.
"""

import random
import socket
import threading
import time

import pytest

from kv_transfer import wire
from kv_transfer.errors import TransferFailed, TransferTimeout, UnknownBackendError
from kv_transfer.leases import LeaseTable
from kv_transfer.transport import get_backend, sockio
from kv_transfer.transport.base import FetchResult, PageSink, PageSource
from tests.unit.kv_grant_fakes import EveryBlockLeased, GrantingClient, engine_grants, grant_for

LAYERS, BLOCKS, PAGE_BYTES = 4, 16, 4096


class BytePages:
    """LAYERS x BLOCKS pages of PAGE_BYTES; implements PageSource and PageSink."""

    def __init__(self, seed: int | None = None):
        rng = random.Random(seed)
        self.data = [[bytearray(rng.randbytes(PAGE_BYTES) if seed is not None else PAGE_BYTES)
                      for _ in range(BLOCKS)] for _ in range(LAYERS)]

    def pages(self, block_ids: list[int]) -> list[memoryview]:
        for block in block_ids:
            if not 0 <= block < BLOCKS:
                raise KeyError(f"block {block} is not held here")
        return [memoryview(self.data[layer][block]) for layer in range(LAYERS) for block in block_ids]


@pytest.fixture
def source():
    return BytePages(seed=7)


@pytest.fixture
def serve(source):
    servers = []

    def start(**kwargs):
        kwargs = {"on_release": lambda rid: None, "on_stats": lambda: {}, "grant_key": engine_grants(),
                  "leases": EveryBlockLeased(BLOCKS), **kwargs}
        server = get_backend("tcp").server("127.0.0.1", 0, source, **kwargs)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def lending_server(source):
    """An unstarted tcp server that lends every block of `source` under the test grants."""
    return get_backend("tcp").server("127.0.0.1", 0, source, on_release=lambda rid: None, on_stats=lambda: {},
                                     leases=EveryBlockLeased(BLOCKS), grant_key=engine_grants())


@pytest.fixture
def client():
    client = GrantingClient(get_backend("tcp").client(), BLOCKS)
    yield client
    client.close()


def _fetch(client, server, block_ids, request_id="req-1", sink=None, timeout_s=5.0):
    sink = sink or BytePages()
    host, port = server.address
    result = client.fetch(host, port, request_id, block_ids, sink.pages(block_ids), timeout_s)
    return result, sink


def _same(source, sink, remote_ids, local_ids=None):
    local_ids = local_ids or remote_ids
    return all(source.data[layer][r] == sink.data[layer][l]
               for layer in range(LAYERS) for r, l in zip(remote_ids, local_ids))


def test_registry_and_interfaces(source):
    backend = get_backend("tcp")
    assert backend.name == "tcp"
    assert isinstance(source, PageSource) and isinstance(source, PageSink)
    with pytest.raises(UnknownBackendError, match="'nixl'; known backends: mooncake, tcp"):
        get_backend("nixl")


def test_fetch_returns_identical_bytes_in_layer_major_order(serve, client, source):
    server = serve()
    sink = BytePages()
    remote, local = [3, 7, 1], [0, 9, 15]
    host, port = server.address
    result = client.fetch(host, port, "req-1", remote, sink.pages(local), 5.0)
    assert isinstance(result, FetchResult)
    assert result.bytes == LAYERS * 3 * PAGE_BYTES and result.seconds > 0
    assert _same(source, sink, remote, local)
    untouched = [b for b in range(BLOCKS) if b not in local]
    assert all(sink.data[layer][b] == bytes(PAGE_BYTES) for layer in range(LAYERS) for b in untouched)


def test_multidimensional_dest_pages_are_filled_in_place(serve, client, source):
    server = serve()
    buffers = [bytearray(PAGE_BYTES) for _ in range(LAYERS)]
    dest = [memoryview(b).cast("B", (64, 64)) for b in buffers]  # like a [heads, dim] tensor page
    client.fetch(*server.address, "r", [5], dest, 5.0)
    assert [bytes(b) for b in buffers] == [bytes(source.data[layer][5]) for layer in range(LAYERS)]


def test_connection_is_reused_between_fetches(serve, client):
    server = serve()
    local_ports = set()
    for _ in range(5):
        _fetch(client, server, [2])
        (sock,) = client._idle[server.address]  # white box: the pool holds one idle connection
        local_ports.add(sock.getsockname()[1])
    assert len(local_ports) == 1


def test_idle_pooled_connection_outlives_the_servers_io_timeout(serve, client):
    server = serve()
    server.io_timeout_s = 0.2  # bounds one exchange, not the wait between exchanges
    _fetch(client, server, [1])
    (first,) = client._idle[server.address]
    time.sleep(0.4)
    _fetch(client, server, [1])
    (second,) = client._idle[server.address]
    assert second is first  # not dropped by the server and silently replaced


def test_server_drops_a_client_that_stalls_mid_message(serve):
    server = serve()
    server.io_timeout_s = 0.3
    with socket.create_connection(server.address, timeout=5) as sock:
        sock.sendall(wire.encode_read_blocks("r", [1])[:10])  # half a header, then nothing
        started = time.monotonic()
        assert sock.recv(1) == b""
        assert time.monotonic() - started < 2.0


def test_unknown_blocks_fail_with_the_server_message_and_keep_the_connection(serve, client, source):
    server = serve(leases=EveryBlockLeased(100))  # leased, but the source holds no block 99
    grant = grant_for("r", range(100))
    dest = [memoryview(bytearray(PAGE_BYTES)) for _ in range(2 * LAYERS)]
    with pytest.raises(TransferFailed, match="block 99 is not held here") as info:
        client.fetch(*server.address, "r", [1, 99], dest, 5.0, grant)
    assert info.value.remote
    (pooled,) = client._idle[server.address]
    sink = BytePages()
    client.fetch(*server.address, "r", [1], sink.pages([1]), 5.0, grant)
    assert client._idle[server.address] == [pooled]  # same pooled connection, still in step
    assert _same(source, sink, [1])


def test_unleased_request_or_blocks_are_refused_when_leases_are_given(serve, client, source):
    leases = LeaseTable()
    leases.grant("held", [3, 7], now_s=0.0, lease_s=60.0)
    server = serve(leases=leases)
    host, port = server.address
    sink = BytePages()
    with pytest.raises(TransferFailed, match="'other' holds no KV lease"):  # a valid grant, but no lease
        client.fetch(host, port, "other", [3], sink.pages([3]), 5.0, grant_for("other", [3]))
    held = grant_for("held", [3, 7])
    with pytest.raises(TransferFailed, match=r"blocks \[3, 1\] are not all leased to request 'held'"):
        client.fetch(host, port, "held", [3, 1], sink.pages([3, 1]), 5.0, held)
    client.fetch(host, port, "held", [7, 3], sink.pages([7, 3]), 5.0, held)
    assert _same(source, sink, [7, 3])


def test_payload_size_mismatch_fails_before_touching_dest_pages(serve, client):
    server = serve()
    small = [memoryview(bytearray(PAGE_BYTES // 2)) for _ in range(LAYERS)]
    with pytest.raises(TransferFailed, match=f"sending {LAYERS * PAGE_BYTES} bytes .* hold {LAYERS * PAGE_BYTES // 2}"):
        client.fetch(*server.address, "r", [2], small, 5.0)
    assert all(bytes(page) == bytes(PAGE_BYTES // 2) for page in small)
    _fetch(client, server, [2])  # the dropped connection is replaced transparently


def test_dest_pages_must_be_whole_layers_and_writable(serve, client):
    server = serve()
    with pytest.raises(ValueError, match="whole number of layers"):
        client.fetch(*server.address, "r", [1, 2], [memoryview(bytearray(PAGE_BYTES))] * 3, 5.0)
    with pytest.raises(ValueError, match="writable"):
        client.fetch(*server.address, "r", [1], [memoryview(bytes(PAGE_BYTES))] * LAYERS, 5.0)


def test_release_calls_on_release_and_reports_its_failure(serve, client):
    released = []

    def on_release(request_id):
        if request_id == "bad":
            raise RuntimeError("engine refused")
        released.append(request_id)

    server = serve(on_release=on_release)
    client.release(*server.address, "req-9", 5.0)
    client.release(*server.address, "req-9", 5.0)
    assert released == ["req-9", "req-9"]  # idempotence is the callback's (LeaseTable's) job
    with pytest.raises(TransferFailed, match="engine refused"):
        client.release(*server.address, "bad", 5.0)


def test_stats_round_trip(serve, client):
    server = serve(on_stats=lambda: {"leases_outstanding": 3, "bytes": 1 << 40, "ok": True})
    assert client.stats(*server.address, 5.0) == {"leases_outstanding": 3, "bytes": 1 << 40, "ok": True}


def test_restarted_server_is_reached_through_a_stale_pooled_connection(source, client):
    backend = get_backend("tcp")
    first = lending_server(source)
    first.start()
    port = first.address[1]
    _fetch(client, first, [1])
    first.stop()  # the pooled connection is now dead
    second = backend.server("127.0.0.1", port, source, lambda r: None, lambda: {},
                            leases=EveryBlockLeased(BLOCKS), grant_key=engine_grants())
    second.start()
    try:
        _, sink = _fetch(client, second, [4])
        assert _same(source, sink, [4])
    finally:
        second.stop()


def test_nothing_listening_fails_fast(client):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(TransferFailed, match="cannot connect"):
        client.fetch("127.0.0.1", port, "r", [1], [memoryview(bytearray(PAGE_BYTES))] * LAYERS, 2.0)


def _fake_server(behaviour):
    """A one-shot peer that reads one request, then does `behaviour(conn)`."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            behaviour(conn)
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    return listener.getsockname()[1]


def test_server_dying_mid_transfer_fails_within_the_timeout(client):
    total = LAYERS * PAGE_BYTES

    def half_then_die(conn):
        conn.sendall(wire.encode_data_prefix("r", total) + b"x" * (total // 2))

    port = _fake_server(half_then_die)
    started = time.monotonic()
    with pytest.raises(TransferFailed, match=f"after {total // 2} of {total}"):
        client.fetch("127.0.0.1", port, "r", [1], [memoryview(bytearray(PAGE_BYTES)) for _ in range(LAYERS)], 5.0)
    assert time.monotonic() - started < 2.0


def test_server_stalling_mid_transfer_times_out_instead_of_hanging(client):
    total = LAYERS * PAGE_BYTES
    release = threading.Event()

    def half_then_stall(conn):
        conn.sendall(wire.encode_data_prefix("r", total) + b"x" * (total // 2))
        release.wait(10)

    port = _fake_server(half_then_stall)
    started = time.monotonic()
    with pytest.raises(TransferTimeout):
        client.fetch("127.0.0.1", port, "r", [1], [memoryview(bytearray(PAGE_BYTES)) for _ in range(LAYERS)], 0.5)
    assert 0.4 < time.monotonic() - started < 2.0
    release.set()


def test_garbage_clients_do_not_crash_the_server(serve, client, source):
    server = serve()
    rng = random.Random(1)
    garbage = [rng.randbytes(4096),  # not our magic
               wire.encode_read_blocks("r", [1])[:12] + b"\xff" * 8,  # our magic, 2**64-1 payload
               wire.encode_read_blocks("r", [1])[:10]]  # truncated, then hang up
    for junk in garbage:
        with socket.create_connection(server.address, timeout=5) as sock:
            sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
            try:
                reply = sock.recv(65536)
            except ConnectionResetError:  # the server hung up with our junk still unread: also fine
                reply = b""
            assert reply == b"" or wire.decode_header(reply[:wire.HEADER_SIZE], 1 << 16).type == wire.MessageType.ERROR
    _, sink = _fetch(client, server, [3, 7, 1])
    assert _same(source, sink, [3, 7, 1])


def test_gather_and_scatter_across_more_pages_than_one_syscall_takes():
    rng = random.Random(3)
    sizes = [rng.choice([0, 1, 7, 100, 4096]) for _ in range(3000)]  # > IOV_MAX (1024) views
    src = [rng.randbytes(n) for n in sizes]
    dst = [bytearray(n) for n in sizes]
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # force many partial sends
    with a, b:
        sender = threading.Thread(target=sockio.send_buffers,
                                  args=(a, [memoryview(s) for s in src], sockio.Deadline(10)))
        sender.start()
        got = sockio.recv_into_pages(b, [memoryview(d) for d in dst], sockio.Deadline(10))
        sender.join()
    assert got == sum(sizes) and [bytes(d) for d in dst] == src


def test_concurrent_fetches_from_four_threads_are_correct(serve, client, source):
    server = serve()
    failures = []

    def worker(seed):
        rng = random.Random(seed)
        for _ in range(10):
            blocks = rng.sample(range(BLOCKS), 4)
            try:
                _, sink = _fetch(client, server, blocks, request_id=f"t{seed}")
                if not _same(source, sink, blocks):
                    failures.append((seed, blocks))
            except Exception as exc:  # collected so the main thread's assert reports it
                failures.append((seed, repr(exc)))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert failures == []


# -- hostile or broken peers ------------------------------------------------------------------


class CountedPages(BytePages):
    num_blocks = BLOCKS  # what kv_pages.PageMap reports: reads may not name more blocks


def test_a_read_naming_a_block_twice_or_more_blocks_than_exist_is_refused(client):
    source = CountedPages(seed=3)
    server = lending_server(source)
    server.start()
    try:
        with pytest.raises(TransferFailed, match="more than once"):
            _fetch(client, server, [1, 2, 1], sink=BytePages())
        host, port = server.address
        many = list(range(BLOCKS + 4))
        # Refused from the header, before the request id and block ids are read: a framing
        # error, answered with an ERROR of no request id (the client reports the mismatch), then closed.
        with pytest.raises(TransferFailed):
            client.fetch(host, port, "req-1", many, [memoryview(bytearray(PAGE_BYTES))] * (LAYERS * len(many)), 5.0)
        with socket.create_connection((host, port), timeout=5) as sock:
            sock.sendall(wire.encode_read_blocks("req-1", many, grant_for("req-1", many)))
            reply = sock.recv(65536)
        assert wire.decode_header(reply[:wire.HEADER_SIZE], 1 << 16).type == wire.MessageType.ERROR
        assert b"names 20 blocks; this engine has 16" in reply
        assert _fetch(client, server, [0, 1])[0]  # still serving
    finally:
        server.stop()


def test_busy_connections_past_the_cap_are_refused_and_served_again_once_one_closes(serve, source, client):
    server = serve()
    server.max_connections = 2
    held = [socket.create_connection(server.address, timeout=5) for _ in range(2)]
    for sock in held:  # mid-message (half a header): busy, so not closed to make room
        sock.sendall(wire.encode_read_blocks("r", [1])[:10])
    time.sleep(0.3)  # both accepted and served by their threads
    with socket.create_connection(server.address, timeout=5) as extra:
        reply = extra.recv(4096)
        assert b"server busy" in reply and extra.recv(4096) == b""  # error, then closed
    assert (server.refused_connections, server.evicted_connections) == (1, 0)
    held.pop().close()
    time.sleep(0.3)
    result, sink = _fetch(client, server, [3])
    assert _same(source, sink, [3])
    for sock in held:
        sock.close()


def test_at_the_cap_the_longest_idle_connection_is_closed_to_make_room(serve, source, client):
    server = serve()
    server.max_connections = 2
    held = []
    for _ in range(2):
        held.append(socket.create_connection(server.address, timeout=5))
        time.sleep(0.1)  # accepted, and idle, in this order
    result, sink = _fetch(client, server, [3])
    assert _same(source, sink, [3])
    assert held[0].recv(1) == b""  # the oldest idle one was closed
    assert (server.evicted_connections, server.refused_connections) == (1, 0)
    assert server.counters()["server_evicted_connections_total"] == 1
    for sock in held:
        sock.close()


def test_an_idle_connection_is_closed_and_the_client_pool_reconnects(serve, source, client):
    server = serve()
    server.idle_timeout_s = 0.3
    with socket.create_connection(server.address, timeout=5) as idle:
        idle.settimeout(3)
        assert idle.recv(1) == b""  # closed by the server, no request ever came
    assert _fetch(client, server, [2])[0]
    time.sleep(0.6)  # the pooled connection the client keeps is now closed by the server
    result, sink = _fetch(client, server, [5])
    assert _same(source, sink, [5])


def test_the_accept_loop_survives_accept_errors(serve, source, client, monkeypatch):
    server = serve()
    server.accept_retry_s = 0.05
    real_accept = server._listener.accept
    failures = iter([OSError(24, "Too many open files")] * 3)

    class Listener:
        def __getattr__(self, name):
            return getattr(server._listener_real, name)

        def accept(self):
            error = next(failures, None)
            if error is not None:
                raise error
            return real_accept()

    server._listener_real = server._listener
    server._listener = Listener()
    deadline = time.monotonic() + 5
    while server.accept_errors < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.accept_errors == 3  # the loop went on after each one
    result, sink = _fetch(client, server, [4], timeout_s=5.0)
    assert _same(source, sink, [4])
    server._listener = server._listener_real


def test_the_accept_loop_survives_running_out_of_threads(serve, source, client, monkeypatch):
    """thread.start() raising ("can't start new thread") refuses that connection only."""
    import threading as threading_module

    from kv_transfer.transport import tcp_server

    server = serve()
    failures = {"left": 2}
    real_start = threading_module.Thread.start

    class FlakyThread(threading_module.Thread):
        def start(self):
            if failures["left"]:
                failures["left"] -= 1
                raise RuntimeError("can't start new thread")
            real_start(self)

    monkeypatch.setattr(tcp_server.threading, "Thread", FlakyThread)
    for _ in range(2):
        with pytest.raises(TransferFailed):
            _fetch(client, server, [4], timeout_s=2.0)
    assert server.accept_errors == 2
    result, sink = _fetch(client, server, [4], timeout_s=5.0)  # the loop is still accepting
    assert _same(source, sink, [4])
