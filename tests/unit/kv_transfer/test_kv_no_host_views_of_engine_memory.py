"""No data path that serves a GPU engine takes a numpy (or memoryview) view of the engine's KV
cache: on CUDA such a view raises, and a `.cpu()` copy would be read or written in place of the
cache. Here the engine's caches are a tensor subclass whose storage refuses `numpy()` (the only
way to a memoryview of a torch tensor) in the GPU-shaped layouts, and the P/D transfer over tcp,
the mooncake backend's registered staging and the KV pool's worker tier each move blocks
through them. A path that viewed engine memory on the host would fail here, on CPU, in CI.
"""

from __future__ import annotations

import time

import pytest
import torch

import kv_transfer.connector_worker as connector_worker
from deployments.ports import reserve_port
from kv_transfer.connector_scheduler import LeaseGrant, PullJob, StepPlan
from kv_transfer.kv_pages import KVPages
from kv_transfer.params import TransferParams
from kv_transfer.settings import ConnectorSettings
from tests.unit.kv_grant_fakes import SECRET, signed
from tests.unit.kv_transfer.test_kv_connector_worker import Side, collect

HOST = "127.0.0.1"
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 8, 16, 2, 16


class EngineMemory(torch.Tensor):
    """A KV cache whose memory may not be viewed on the host (as a CUDA cache cannot)."""

    storages: set[int] = set()

    def numpy(self, *args, **kwargs):
        if self.untyped_storage().data_ptr() in EngineMemory.storages:
            raise AssertionError("a data path took a host view (numpy/memoryview) of engine KV memory")
        return super().numpy(*args, **kwargs)


def engine_caches(layout: str, seed: int | None) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    caches = {}
    for layer in range(LAYERS):
        if layout == "token_major":  # CUDA GQA: [blocks, heads, tokens, dim] view of token-major memory
            shape = (BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
            buffer = torch.randn(*shape, generator=generator) if seed is not None else torch.zeros(shape)
            cache = buffer.permute(0, 2, 1, 3)
        else:  # K/V split before the block dimension
            shape = (2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
            cache = torch.randn(*shape, generator=generator) if seed is not None else torch.zeros(shape)
        guarded = cache.as_subclass(EngineMemory)
        EngineMemory.storages.add(guarded.untyped_storage().data_ptr())
        caches[f"model.layers.{layer}.self_attn.attn"] = guarded
    return caches


def test_the_guard_catches_a_host_view():
    cache = engine_caches("kv_split", 0)["model.layers.0.self_attn.attn"]
    with pytest.raises(AssertionError, match="host view"):
        memoryview(cache[0, 1].numpy())
    copy = torch.empty_like(cache).copy_(cache)  # a copy is ours to view
    copy.as_subclass(torch.Tensor).numpy()


@pytest.mark.parametrize("backend", ["tcp", "mooncake"])
@pytest.mark.parametrize("layout", ["token_major", "kv_split"])
def test_p_d_transfer_never_views_engine_memory(backend, layout):
    if backend == "mooncake":
        pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine wheel not installed")
        if layout == "kv_split":
            pytest.skip("a dense host cache is read in place by design (CPU engines only)")
    sides = []
    try:
        for engine_id, seed in (("prefill-0", 3), ("decode-0", None)):
            port = reserve_port(HOST)
            worker = connector_worker.WorkerSide(ConnectorSettings(
                backend=backend, host=HOST, port=port, engine_id=engine_id, transfer_timeout_s=5.0,
                grant_secret=SECRET, lends_kv=engine_id.startswith("prefill-"), staging_bytes=4 << 20))
            caches = engine_caches(layout, seed)
            pages = KVPages(caches, num_blocks=BLOCKS)
            worker.register(pages)
            pages.caches = list(caches.values())
            sides.append(Side(worker, pages, port, engine_id))
        prefill, decode = sides
        prefill.worker.apply(StepPlan(grants=[LeaseGrant("p-1", (5, 2), 30.0)]))
        params = signed(TransferParams(
            remote_host=HOST, remote_port=prefill.port, remote_engine_id="prefill-0", remote_request_id="p-1",
            remote_block_ids=(5, 2), remote_num_tokens=2 * BLOCK_SIZE, block_size_tokens=BLOCK_SIZE,
            lease_deadline_unix_s=time.time() + 30))
        decode.worker.apply(StepPlan(pulls=[PullJob("d-1", params, (0, 1), (5, 2))]))
        assert collect(decode, lambda r: "d-1" in r.recving).failed == set()
        for local, remote in ((0, 5), (1, 2)):
            for got, sent in zip(decode.pages.caches, prefill.pages.caches):
                block = (lambda t, b: t[:, b]) if layout == "kv_split" else (lambda t, b: t[b])
                assert torch.equal(block(got, local).as_subclass(torch.Tensor),
                                   block(sent, remote).as_subclass(torch.Tensor))
    finally:
        for side in sides:
            side.worker.shutdown()


def test_the_pool_tier_never_views_engine_memory():
    from kv_transfer.pool.health import PoolHealth
    from kv_transfer.pool.objects import HEADER_BYTES
    from kv_transfer.pool.worker_tier import PoolWorker
    from tests.unit.kv_pool_fakes import FakePoolStore
    from tests.unit.kv_transfer.test_kv_pool_tier import KEYS, blocks_of, request

    source_caches, dest_caches = engine_caches("token_major", 5), engine_caches("token_major", None)
    source, dest = KVPages(source_caches, num_blocks=BLOCKS), KVPages(dest_caches, num_blocks=BLOCKS)
    store = FakePoolStore()
    staging = 3 * (HEADER_BYTES + source.num_layers * source.page_bytes)
    writer, reader = (PoolWorker(lambda: store, KEYS, 0, PoolHealth(10), staging_bytes=staging) for _ in range(2))
    writer.attach(source)
    reader.attach(dest)
    req = request(prompt_len=64)
    assert writer.store(blocks_of(req, [1, 2, 3, 4])) == 4
    reader.load(blocks_of(req, [4, 5, 6, 7]))
    for got, sent in zip(dest_caches.values(), source_caches.values()):
        for local, remote in zip((4, 5, 6, 7), (1, 2, 3, 4)):
            assert torch.equal(got[local].as_subclass(torch.Tensor), sent[remote].as_subclass(torch.Tensor))
