"""The "mooncake" P/D backend on caches it cannot move in place (GPU memory, strided blocks):
blocks staged through one host arena each worker registers once.

Two real WorkerSides (prefill and decode) on Mooncake's real transfer engine over TCP, with
caches in CUDA's token-major GQA layout (a block is dense but its view is not contiguous), on
MOE_SERVE_KV_TEST_DEVICE (CPU here; scripts/gpu_selfcheck.sh runs them on CUDA). Skipped where
the Mooncake wheel is not installed.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine wheel not installed")

import kv_transfer.connector_worker as connector_worker  # noqa: E402
from deployments.ports import reserve_port  # noqa: E402
from kv_transfer.connector_scheduler import LeaseGrant, PullJob, StepPlan  # noqa: E402
from kv_transfer.host_staging import RegisteredStaging, StagingExhausted  # noqa: E402
from kv_transfer.kv_pages import KVPages, RegisteredKVStaging  # noqa: E402
from kv_transfer.params import TransferParams  # noqa: E402
from kv_transfer.settings import ConnectorSettings  # noqa: E402
from tests.unit.kv_grant_fakes import SECRET, signed  # noqa: E402
from tests.unit.kv_transfer.test_kv_connector_worker import Side, collect  # noqa: E402

DEVICE = os.environ.get("MOE_SERVE_KV_TEST_DEVICE", "cpu")
HOST = "127.0.0.1"
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 10, 16, 2, 32


def token_major_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """[blocks, heads, tokens, dim] views of token-major buffers, as CUDA's GQA backends lay them out."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    caches = {}
    for layer in range(LAYERS):
        shape = (BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
        buffer = torch.randn(*shape, generator=generator) if seed is not None else torch.zeros(shape)
        caches[f"model.layers.{layer}.self_attn.attn"] = buffer.to(DEVICE).permute(0, 2, 1, 3)
    return caches


@pytest.fixture
def make_side():
    sides: list[Side] = []

    def make(engine_id: str, seed: int | None = None, staging_mib: int = 4) -> Side:
        port = reserve_port(HOST)
        worker = connector_worker.WorkerSide(ConnectorSettings(
            backend="mooncake", host=HOST, port=port, engine_id=engine_id, transfer_timeout_s=5.0,
            grant_secret=SECRET, lends_kv=engine_id.startswith("prefill-"), staging_bytes=staging_mib << 20))
        caches = token_major_caches(seed)
        pages = KVPages(caches, num_blocks=BLOCKS)
        pages.caches = list(caches.values())
        worker.register(pages)
        side = Side(worker, pages, port, engine_id)
        sides.append(side)
        return side

    yield make
    for side in sides:
        side.worker.shutdown()


def params(prefill: Side, request_id: str, block_ids) -> TransferParams:
    return signed(TransferParams(
        remote_host=HOST, remote_port=prefill.port, remote_engine_id=prefill.engine_id,
        remote_request_id=request_id, remote_block_ids=tuple(block_ids),
        remote_num_tokens=BLOCK_SIZE * len(block_ids), block_size_tokens=BLOCK_SIZE,
        lease_deadline_unix_s=time.time() + 30))


def block(side: Side, block_id: int) -> list[torch.Tensor]:
    """Every layer's values of one block, read from the cache itself."""
    return [cache[block_id].cpu() for cache in side.pages.caches]


def test_a_pull_through_registered_staging_copies_the_blocks_and_frees_the_arena(make_side):
    prefill, decode = make_side("prefill-0", seed=4), make_side("decode-0")
    assert isinstance(prefill.worker._pages, RegisteredKVStaging)  # not in place: the cache is strided
    remote, local = (7, 2, 5), (0, 1, 3)
    prefill.worker.apply(StepPlan(grants=[LeaseGrant("p-1", remote, 30.0)]))
    decode.worker.apply(StepPlan(pulls=[PullJob("d-1", params(prefill, "p-1", remote), local, remote)]))
    assert collect(decode, lambda r: "d-1" in r.recving).failed == set()
    for local_block, remote_block in zip(local, remote):
        assert all(torch.equal(a, b) for a, b in zip(block(decode, local_block), block(prefill, remote_block)))
    assert all(torch.count_nonzero(t) == 0 for b in (4, 6, 8) for t in block(decode, b))  # nothing else
    assert collect(prefill, lambda r: "p-1" in r.sending).sending == {"p-1"}  # decode released it
    server = prefill.worker._server
    assert server.held_requests == 0  # the release let the described snapshot go
    deadline = time.monotonic() + 5
    while prefill.worker._pages._staging.in_use_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefill.worker._pages._staging.in_use_bytes == 0
    assert decode.worker._pages._staging.in_use_bytes == 0


def test_a_full_arena_fails_the_pull_instead_of_waiting(make_side):
    # Prefill's arena holds 1 MiB; the snapshot of 10 blocks x 3 layers x 4 KiB (120 KiB) fits,
    # a second one held meanwhile does not: its DESCRIBE fails, the pull falls to the policy.
    prefill, decode = make_side("prefill-0", seed=1, staging_mib=1), make_side("decode-0")
    staging = prefill.worker._pages._staging
    hog = staging.take((1 << 20,))  # everything, as transfers in flight would
    prefill.worker.apply(StepPlan(grants=[LeaseGrant("p-2", (1, 2), 30.0)]))
    decode.worker.apply(StepPlan(pulls=[PullJob("d-2", params(prefill, "p-2", (1, 2)), (0, 1), (1, 2))]))
    assert collect(decode, lambda r: "d-2" in r.recving).failed == {"d-2"}
    staging.give_back(hog)
    assert staging.in_use_bytes == 0


def test_registered_staging_reuses_its_memory_and_never_grows():
    staging = RegisteredStaging(4 << 20, pinned=False)
    (address, nbytes), = staging.regions()
    first = staging.take((3, 100_000))
    assert address <= first.data_ptr() < address + nbytes
    staging.give_back(first)
    again = staging.take((2, 150_000))  # the same range, first fit
    assert again.data_ptr() == first.data_ptr()
    staging.give_back(again)
    whole = staging.take((4 << 20,))
    with pytest.raises(StagingExhausted, match="staging_mib"):
        staging.take((1,))
    staging.give_back(whole)
    assert staging.in_use_bytes == 0 and staging.regions() == [(address, nbytes)]


def test_registered_staging_merges_what_comes_back():
    """Many small transfers, given back in any order, leave room for one that needs it all."""
    staging = RegisteredStaging(1 << 20, pinned=False)
    small = [staging.take((4096 * (1 + i % 3),)) for i in range(40)]
    for buffer in small[1::2] + small[0::2]:
        staging.give_back(buffer)
    assert staging.take((1 << 20,)).data_ptr() == staging.regions()[0][0]
