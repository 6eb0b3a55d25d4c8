"""KV transfer between tensor-parallel engines: one KV endpoint per TP rank.

Each of a TP engine's workers holds its own shard of every block (its KV heads) and serves it on
the engine's first port + its rank; transfer parameters carry the first port and the TP size,
signed into the grant. Here two TP=2 engines (prefill and decode) are four real WorkerSides over
the real tcp transport, each rank over its own KVPages whose bytes differ by rank (as head
shards do): decode's rank r must end up with exactly prefill rank r's shard, and every prefill
rank's lease must be released.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

import kv_transfer.connector_worker as connector_worker
from deployments.ports import reserve_port
from kv_transfer.connector_scheduler import LeaseGrant, PullJob, StepPlan
from kv_transfer.grants import GrantKey
from kv_transfer.params import InvalidTransferParams, TransferParams
from kv_transfer.rank_stats import merge_rank_stats
from kv_transfer.releaser import BackgroundReleaser
from kv_transfer.settings import ConnectorSettings
from tests.unit.kv_grant_fakes import SECRET, signed
from tests.unit.kv_transfer.test_kv_connector_worker import HOST, LAYERS, PAGE_BYTES, BytePages, Side, collect

TP = 2


@pytest.fixture
def make_engine():
    sides: list[Side] = []

    def make(engine_id: str, tp_size: int = TP, seed: int | None = None) -> list[Side]:
        """One engine's workers, rank 0..tp_size-1, on consecutive ports from one reserved base."""
        port = reserve_port(HOST, count=tp_size)
        settings = ConnectorSettings(host=HOST, port=port, tp_size=tp_size, engine_id=engine_id,
                                     transfer_timeout_s=2.0, grant_secret=SECRET,
                                     lends_kv=engine_id.startswith("prefill-"))
        ranks = []
        for rank in range(tp_size):
            worker = connector_worker.WorkerSide(settings, tp_rank=rank)
            side = Side(worker, BytePages(None if seed is None else seed + rank), port + rank, engine_id)
            worker.register(side.pages)
            sides.append(side)
            ranks.append(side)
        return ranks

    yield make
    for side in sides:
        side.worker.shutdown()


def lease_params(prefill: list[Side], request_id: str, block_ids, tp_size: int = TP) -> TransferParams:
    """What a TP prefill's scheduler side hands decode: its first port, its TP size, signed."""
    return signed(TransferParams(
        remote_host=HOST, remote_port=prefill[0].port, remote_engine_id=prefill[0].engine_id,
        remote_request_id=request_id, remote_block_ids=tuple(block_ids), remote_num_tokens=16 * len(block_ids),
        block_size_tokens=16, lease_deadline_unix_s=time.time() + 10, remote_tp_size=tp_size))


def every_rank(engine: list[Side], plan: StepPlan) -> None:
    """vLLM hands every worker of an engine the same connector metadata each step."""
    for side in engine:
        side.worker.apply(plan)


def test_each_decode_rank_pulls_its_own_shard_and_releases_its_prefill_rank(make_engine):
    prefill, decode = make_engine("prefill-0", seed=11), make_engine("decode-0")
    assert prefill[0].pages.block(3) != prefill[1].pages.block(3)  # the ranks' shards differ
    remote, local = (3, 8, 1), (0, 5, 6)
    every_rank(prefill, StepPlan(grants=[LeaseGrant("p-1", remote, 10.0)]))

    every_rank(decode, StepPlan(pulls=[PullJob("d-1", lease_params(prefill, "p-1", remote), local, remote)]))
    for rank in range(TP):
        assert collect(decode[rank], lambda r: "d-1" in r.recving).failed == set()
        for local_block, remote_block in zip(local, remote):
            assert decode[rank].pages.block(local_block) == prefill[rank].pages.block(remote_block)
        # Every rank of prefill is released by its own decode rank: its lease ends, its blocks go.
        assert collect(prefill[rank], lambda r: "p-1" in r.sending).sending == {"p-1"}
        stats = prefill[rank].worker.stats()
        assert (stats["leases_outstanding"], stats["leases_released_total"]) == (0, 1)
    moved = [decode[rank].worker.stats()["bytes_loaded_total"] for rank in range(TP)]
    assert moved == [len(local) * LAYERS * PAGE_BYTES] * TP
    merged = merge_rank_stats([decode[rank].worker.stats() for rank in range(TP)])
    assert merged["bytes_loaded_total"] == TP * len(local) * LAYERS * PAGE_BYTES  # the engine's bytes
    assert merged["pulls_succeeded_total"] == 1  # one request's pull, whatever the rank count


def test_a_tp_mismatch_fails_the_pull_and_releases_every_prefill_rank(make_engine):
    prefill, decode = make_engine("prefill-0", seed=5), make_engine("decode-0", tp_size=1)
    every_rank(prefill, StepPlan(grants=[LeaseGrant("p-2", (2, 4), 10.0)]))
    every_rank(decode, StepPlan(pulls=[PullJob("d-2", lease_params(prefill, "p-2", (2, 4)), (0, 1), (2, 4))]))
    assert collect(decode[0], lambda r: "d-2" in r.recving).failed == {"d-2"}  # recomputed, never loaded
    assert decode[0].pages.block(0) == [bytes(PAGE_BYTES)] * LAYERS
    for rank in range(TP):  # decode's one worker released the lease on both prefill ranks
        assert collect(prefill[rank], lambda r: "p-2" in r.sending).sending == {"p-2"}


def test_the_grant_covers_the_tp_size():
    params = signed(TransferParams(
        remote_host=HOST, remote_port=20_000, remote_engine_id="prefill-0", remote_request_id="p-3",
        remote_block_ids=(1, 2), remote_num_tokens=32, block_size_tokens=16,
        lease_deadline_unix_s=time.time() + 10, remote_tp_size=TP))
    key = GrantKey(SECRET)
    assert key.check(params.grant_scope(), params.grant_bytes(), None) is None
    # A record whose TP size was changed would send decode ranks to other ports: it does not verify.
    assert key.check(replace(params, remote_tp_size=4).grant_scope(), params.grant_bytes(), None) is not None
    assert list(params.rank_ports()) == [20_000, 20_001] and params.rank_port(1) == 20_001
    with pytest.raises(ValueError):
        params.rank_port(TP)
    engine = params.to_engine()
    assert TransferParams.from_engine(engine) == params
    legacy = {k: v for k, v in engine.items() if k != "remote_tp_size"}
    assert TransferParams.from_engine(legacy).remote_tp_size == 1
    for bad in (0, 65, "2", True):
        with pytest.raises(InvalidTransferParams, match="remote_tp_size"):
            TransferParams.from_engine({**engine, "remote_tp_size": bad})
    with pytest.raises(InvalidTransferParams, match="remote_port"):
        TransferParams.from_engine({**engine, "remote_port": 65535})


def test_a_release_from_outside_the_workers_reaches_every_rank(make_engine):
    """What the engine server's release() and the scheduler side's release_now send."""
    prefill = make_engine("prefill-0", seed=1)
    every_rank(prefill, StepPlan(grants=[LeaseGrant("p-4", (6, 7), 10.0)]))
    releaser = BackgroundReleaser(2.0)
    try:
        releaser.submit(lease_params(prefill, "p-4", (6, 7)))
        for rank in range(TP):
            assert collect(prefill[rank], lambda r: "p-4" in r.sending).sending == {"p-4"}
    finally:
        releaser.shutdown()


def test_settings_give_each_rank_its_port():
    settings = ConnectorSettings(port=30_000, tp_size=4)
    assert [settings.rank_port(r) for r in range(4)] == [30_000, 30_001, 30_002, 30_003]
    with pytest.raises(ValueError):
        settings.rank_port(4)
    with pytest.raises(ValueError, match="tp_size"):
        ConnectorSettings.from_extra_config({"port": 65_535, "tp_size": 2})


def test_merge_rank_stats():
    ranks = [{"bytes_loaded_total": 10, "pulls_failed_total": 0, "leases_outstanding": 2, "pool_up": 1,
              "server_refused_connections_total": 1, "pull_seconds_total": 0.5},
             {"bytes_loaded_total": 12, "pulls_failed_total": 1, "leases_outstanding": 2, "pool_up": 0,
              "server_refused_connections_total": 2, "pull_seconds_total": 0.7}]
    assert merge_rank_stats(ranks) == {"bytes_loaded_total": 22, "pulls_failed_total": 1, "leases_outstanding": 2,
                                       "pool_up": 0, "server_refused_connections_total": 3,
                                       "pull_seconds_total": 0.7}
    assert merge_rank_stats(ranks[:1]) == ranks[0] and merge_rank_stats([]) == {}
