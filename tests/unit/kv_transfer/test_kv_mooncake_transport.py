"""The "mooncake" KV transport on Mooncake's real transfer engine (TCP protocol, loopback).

Server and client run in this one process with a TransferEngine each. Skipped where the
Mooncake wheel is not installed. As in test_kv_tcp_transport.py, servers lend every block under
the test grants and the client presents them (kv_grant_fakes).
"""

import random

import numpy as np
import pytest

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine wheel not installed")

from kv_transfer.errors import TransferFailed  # noqa: E402
from kv_transfer.leases import LeaseTable  # noqa: E402
from kv_transfer.transport import get_backend  # noqa: E402
from kv_transfer.transport import mooncake_client  # noqa: E402
from tests.unit.kv_grant_fakes import EveryBlockLeased, GrantingClient, engine_grants, grant_for  # noqa: E402

LAYERS, BLOCKS, PAGE_BYTES = 3, 12, 4096


class BytePages:
    """LAYERS x BLOCKS bytearray pages, no regions(): the backend registers page by page."""

    def __init__(self, seed: int | None = None, page_bytes: int = PAGE_BYTES):
        rng = random.Random(seed)
        self.data = [[bytearray(rng.randbytes(page_bytes) if seed is not None else page_bytes)
                      for _ in range(BLOCKS)] for _ in range(LAYERS)]

    def pages(self, block_ids):
        for block in block_ids:
            if not 0 <= block < BLOCKS:
                raise KeyError(f"block {block} is not held here")
        return [memoryview(self.data[layer][b]) for layer in range(LAYERS) for b in block_ids]

    def page(self, layer, block) -> bytes:
        return bytes(self.data[layer][block])


class ArrayPages:
    """One [BLOCKS, PAGE_BYTES] numpy array per layer, with regions() like KVPages."""

    def __init__(self, seed: int | None = None):
        rng = np.random.default_rng(seed)
        self.layers = [rng.integers(0, 256, (BLOCKS, PAGE_BYTES), dtype=np.uint8) if seed is not None
                       else np.zeros((BLOCKS, PAGE_BYTES), np.uint8) for _ in range(LAYERS)]

    def regions(self):
        return [(a.ctypes.data, a.nbytes) for a in self.layers]

    def pages(self, block_ids):
        return [memoryview(layer[b]) for layer in self.layers for b in block_ids]

    def page(self, layer, block) -> bytes:
        return self.layers[layer][block].tobytes()


@pytest.fixture(scope="module")
def backend():
    return get_backend("mooncake")


class Served:
    """A started server over `source` that records releases (stopping an engine that has
    served reads takes Mooncake about 1 s, so tests share servers where they can)."""

    def __init__(self, backend, source, **kwargs):
        self.source, self.released = source, []
        kwargs = {"leases": EveryBlockLeased(BLOCKS), "grant_key": engine_grants(), **kwargs}
        self.server = backend.server("127.0.0.1", 0, source, self.released.append,
                                     lambda: {"served": 3, "backend": "mooncake"}, **kwargs)
        self.server.start()
        self.address = self.server.address


@pytest.fixture(scope="module")
def byte_server(backend):
    served = Served(backend, BytePages(seed=1))
    yield served
    served.server.stop()


@pytest.fixture(scope="module")
def array_server(backend):
    served = Served(backend, ArrayPages(seed=2))
    yield served
    served.server.stop()


@pytest.fixture(scope="module")
def client(backend):
    client = GrantingClient(backend.client(), BLOCKS)
    yield client
    client.close()


@pytest.fixture
def array_sink(client):
    """Zeroed ArrayPages whose regions the client registered. One for the module: registered
    regions stay with the engine, so a freed sink would leave ranges a new one may overlap."""
    sink = _ARRAY_SINK
    for layer in sink.layers:
        layer[:] = 0
    client.register_sink(sink)  # idempotent: covered regions are not registered again
    return sink


_ARRAY_SINK = ArrayPages()


def _same(source, sink, remote_ids, local_ids):
    return all(source.page(layer, r) == sink.page(layer, l)
               for layer in range(LAYERS) for r, l in zip(remote_ids, local_ids))


@pytest.mark.parametrize("server_name,sink_name", [
    ("byte_server", "byte_sink"), ("array_server", "array_sink"), ("array_server", "byte_sink")])
def test_fetch_is_byte_identical(request, client, server_name, sink_name):
    served = request.getfixturevalue(server_name)
    sink = BytePages() if sink_name == "byte_sink" else request.getfixturevalue(sink_name)
    remote, local = [3, 7, 1], [0, 5, 9]
    result = client.fetch(*served.address, "req-1", remote, sink.pages(local), 10.0)
    assert result.bytes == LAYERS * 3 * PAGE_BYTES and result.seconds > 0
    assert _same(served.source, sink, remote, local)
    assert not _same(served.source, sink, [0], [1])  # the rest was not touched
    client.fetch(*served.address, "req-2", [0], sink.pages([1]), 10.0)  # reuses registrations
    assert _same(served.source, sink, [0], [1])


def test_adjacent_pages_in_regions_are_read_as_one_range(array_server, client, array_sink, monkeypatch):
    planned = []
    plan = mooncake_client.plan_reads
    monkeypatch.setattr(mooncake_client, "plan_reads", lambda *a: planned.append(plan(*a)) or planned[-1])
    sink = array_sink
    client.fetch(*array_server.address, "req-3", [4, 5, 6, 9], sink.pages([2, 3, 4, 5]), 10.0)
    assert _same(array_server.source, sink, [4, 5, 6, 9], [2, 3, 4, 5])
    assert planned[0].lengths == [3 * PAGE_BYTES, PAGE_BYTES] * LAYERS


def test_lease_refusal_is_transfer_failed(backend, client):
    leases = LeaseTable()
    served, sink = Served(backend, BytePages(seed=3), leases=leases), BytePages()
    try:
        grant = grant_for("req-x", [3])
        with pytest.raises(TransferFailed, match="holds no KV lease") as info:
            client.fetch(*served.address, "req-x", [3], sink.pages([3]), 5.0, grant)
        assert info.value.remote
        leases.grant("req-x", [3], now_s=0.0, lease_s=1e12)
        with pytest.raises(TransferFailed, match="not all leased"):
            client.fetch(*served.address, "req-x", [3, 4], sink.pages([3, 4]), 5.0, grant)
        assert sink.page(0, 3) == bytes(PAGE_BYTES)
        client.fetch(*served.address, "req-x", [3], sink.pages([3]), 5.0, grant)
        assert _same(served.source, sink, [3], [3])
    finally:
        served.server.stop()


def test_unknown_block_is_transfer_failed(backend, client):
    served = Served(backend, BytePages(seed=1), leases=EveryBlockLeased(100))  # leased, but not held
    try:
        with pytest.raises(TransferFailed, match="cannot serve blocks"):
            client.fetch(*served.address, "req-1", [99], BytePages().pages([0]), 5.0, grant_for("req-1", range(100)))
    finally:
        served.server.stop()


def test_release_and_stats_round_trip(byte_server, client):
    client.release(*byte_server.address, "req-9", 5.0)
    assert byte_server.released[-1] == "req-9"
    assert client.stats(*byte_server.address, 5.0) == {"served": 3, "backend": "mooncake"}


def test_page_size_mismatch_is_transfer_failed(byte_server, client):
    sink = BytePages(page_bytes=PAGE_BYTES // 2)
    with pytest.raises(TransferFailed, match="different KV layouts"):
        client.fetch(*byte_server.address, "req-1", [2], sink.pages([2]), 5.0)
    assert sink.page(0, 2) == bytes(PAGE_BYTES // 2)


def test_page_count_mismatch_is_transfer_failed(byte_server, client):
    sink = BytePages()
    with pytest.raises(TransferFailed):  # 2 layers of dest pages, the server has 3
        client.fetch(*byte_server.address, "req-1", [2], sink.pages([2])[:2], 5.0)


def test_tcp_server_refuses_describe(client):
    server = get_backend("tcp").server("127.0.0.1", 0, BytePages(seed=7), lambda rid: None, lambda: {})
    server.start()
    try:
        with pytest.raises(TransferFailed, match="DESCRIBE_BLOCKS is not a request"):
            client.fetch(*server.address, "req-1", [1], BytePages().pages([1]), 5.0)
    finally:
        server.stop()


def test_kv_pages_of_torch_caches_round_trip(backend):
    """The vLLM adapter on both sides: layer caches as views into one buffer, regions() used."""
    torch = pytest.importorskip("torch")
    from kv_transfer.kv_pages import KVPages

    prefill_buf = torch.randn(2, BLOCKS, 2, 32, 16, generator=torch.Generator().manual_seed(0))
    decode_buf = torch.zeros_like(prefill_buf)

    def as_the_connector_serves(pages):  # kv_transfer.connector_worker.WorkerSide.register
        return pages.host_memory() if backend.moves_engine_memory else pages

    source = as_the_connector_serves(KVPages({f"model.layers.{i}.attn": prefill_buf[i] for i in range(2)}))
    sink = as_the_connector_serves(KVPages({f"model.layers.{i}.attn": decode_buf[i] for i in range(2)}))
    client = GrantingClient(backend.client(), BLOCKS)  # its own: the sink's regions stay registered with its engine
    client.register_sink(sink)
    served = Served(backend, source)
    try:
        with sink.receiving([0, 11]) as dest:
            client.fetch(*served.address, "req-t", [4, 2], dest, 5.0)
    finally:
        served.server.stop()
        client.close()
    assert torch.equal(decode_buf[:, [0, 11]], prefill_buf[:, [4, 2]])
    assert decode_buf[:, 1:11].abs().sum() == 0
