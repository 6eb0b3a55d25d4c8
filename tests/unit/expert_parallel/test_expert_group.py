"""ExpertParallelGroup with fake ranks: rank assignment, routing, gang failure, stats (no Ray, no vLLM)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from deployments.expert_parallel.expert_group import ExpertParallelGroup
from deployments.expert_parallel.expert_ranks import group_stats
from deployments.expert_parallel.expert_ranks import (CPU_COMPAT_EXTENSION, OBSERVATION_EXTENSION, merge_expert_load,
                                                      pick_rank, rank_engine_spec)
from deployments.records import EngineFailure, EngineRequest, SamplingSpec, ServerStats, TokenDelta
from tests.unit.ingress_fakes import FakeMetricsBackend

ENGINE = {"max_num_seqs": 8, "extra_args": {"trust_remote_code": True}}


class FakeServer:
    """LLMServer's interface; `gate` holds generate() open until set."""

    def __init__(self, model, engine, model_path, kv_transfer, *, pool="engine", rank=0, metrics=True,
                 request_timeouts=None):
        self.engine, self.rank, self.pool = engine, rank, pool
        self.requests: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.aborted: list[str] = []
        self.aborted_by_id: list[str] = []
        self.shut_down = False
        self.observation_error: Exception | None = None  # what the engine's expert RPCs raise

    async def abort(self, request_id):
        self.aborted_by_id.append(request_id)

    async def generate(self, request):
        self.requests.append(request.request_id)
        try:
            yield TokenDelta("a", [1], None, 3, 1)
            await self.gate.wait()
            yield TokenDelta("b", [2], "length", 3, 2)
        except (GeneratorExit, asyncio.CancelledError):
            self.aborted.append(request.request_id)
            raise

    async def stats(self):
        return ServerStats(replica_id=f"r{self.rank}", started_total=len(self.requests),
                           kv_transfer={"leases_outstanding": self.rank, "backend": "tcp"})

    async def routed_tokens_per_expert(self):
        if self.observation_error:
            raise self.observation_error
        return {4 * self.rank + e: 10 + e for e in range(4)}

    async def placement(self):
        if self.observation_error:
            raise self.observation_error
        return {"process_id": 100 + self.rank, "node_id": "n", "layers": [{"local_expert_ids": [self.rank]}],
                "parameter_bytes": {"total": 1}}

    async def check_health(self):
        return None

    def shutdown_engine(self):
        self.shut_down = True


class _Method:
    def __init__(self, fn, streaming=False):
        self._fn, self._streaming = fn, streaming

    def remote(self, *args):
        if self._streaming:
            async def refs():
                async for item in self._fn(*args):
                    future = asyncio.get_running_loop().create_future()
                    future.set_result(item)
                    yield future
            return refs()
        result = self._fn(*args)
        # Ray submits at .remote(), awaited or not (a fire-and-forget call still runs).
        return asyncio.ensure_future(result) if asyncio.iscoroutine(result) else result


class FakeRankActor:
    """A Ray actor handle over a FakeServer; `die()` ends its never-ending call like Ray does."""

    def __init__(self, server: FakeServer):
        self.server = server
        self.dead = asyncio.Event()
        self.generate = _Method(server.generate, streaming=True)
        self.stats = _Method(server.stats)
        self.routed_tokens_per_expert = _Method(server.routed_tokens_per_expert)
        self.placement = _Method(server.placement)
        self.wait_forever = _Method(self._wait_forever)
        self.shutdown_engine = _Method(server.shutdown_engine)
        self.check_health = _Method(server.check_health)
        self.abort = _Method(server.abort)

    async def _wait_forever(self):
        await self.dead.wait()
        raise RuntimeError("ActorDiedError: the rank's process died")


CANCELLED: list = []  # remote streams the group cancelled (ray.cancel in production)


def make_group(size=2):
    remotes: list[FakeRankActor] = []
    locals_: list[FakeServer] = []

    def remote_factory(rank, model, engine, model_path, kv_transfer, **kwargs):
        actor = FakeRankActor(FakeServer(model, engine, model_path, kv_transfer, rank=rank, **kwargs))
        remotes.append(actor)
        return actor

    def local_factory(*args, **kwargs):
        server = FakeServer(*args, **kwargs)
        locals_.append(server)
        return server

    group = ExpertParallelGroup({"name": "m"}, ENGINE, "/ckpt", None, {"size": size, "rank_failure_timeout_s": 1.0},
                                {}, "cpu", pool_name="decode", remote_rank_factory=remote_factory,
                                local_server_factory=local_factory, metrics_backend=FakeMetricsBackend(),
                                cancel_remote=lambda refs: CANCELLED.append(refs))
    return group, locals_[0], remotes


def request(i):
    return EngineRequest(f"req-{i}", [1, 2, 3], SamplingSpec(max_tokens=2))


async def drain(stream):
    return [item async for item in stream]


def test_rank_specs_differ_only_in_rank_and_carry_the_rendezvous():
    specs = [rank_engine_spec(ENGINE, size=2, rank=r, address="10.0.0.5", rpc_port=4000, accelerator="cpu")
             for r in range(2)]
    for rank, spec in enumerate(specs):
        extra = spec["extra_args"]
        assert extra["data_parallel_rank"] == rank and extra["data_parallel_size"] == 2
        assert (extra["data_parallel_address"], extra["data_parallel_rpc_port"]) == ("10.0.0.5", 4000)
        assert extra["enable_expert_parallel"] and extra["distributed_executor_backend"] == "mp"
        assert extra["worker_extension_cls"] == CPU_COMPAT_EXTENSION and extra["trust_remote_code"]
    gpu = rank_engine_spec(ENGINE, size=4, rank=3, address="a", rpc_port=1, accelerator="gpu", enable_eplb=True,
                           num_redundant_experts=8)["extra_args"]
    # Every platform loads the observation methods; only CPU adds the shim around them.
    assert gpu["worker_extension_cls"] == OBSERVATION_EXTENSION and gpu["eplb_config"] == {"num_redundant_experts": 8}
    with pytest.raises(ValueError):
        rank_engine_spec(ENGINE, size=2, rank=2, address="a", rpc_port=1, accelerator="cpu")


def test_a_pool_cannot_replace_the_ranks_worker_extension():
    engine = {**ENGINE, "extra_args": {"worker_extension_cls": "my.Extension"}}
    with pytest.raises(ValueError, match="my.Extension.*drop the setting"):
        rank_engine_spec(engine, size=2, rank=0, address="a", rpc_port=1, accelerator="gpu")
    same = {**ENGINE, "extra_args": {"worker_extension_cls": OBSERVATION_EXTENSION}}
    assert rank_engine_spec(same, size=2, rank=0, address="a", rpc_port=1,
                            accelerator="gpu")["extra_args"]["worker_extension_cls"] == OBSERVATION_EXTENSION


def test_pick_rank_takes_the_least_loaded_lowest_first():
    assert pick_rank([0, 0]) == 0
    assert pick_rank([2, 1, 1]) == 1
    assert merge_expert_load([{0: 3, 1: 1}, {2: 5}, {1: 1}]) == {0: 3, 1: 2, 2: 5}


def test_requests_spread_over_ranks_and_stats_sum_them():
    async def scenario():
        group, local, (remote,) = make_group()
        local.gate.clear()
        remote.server.gate.clear()
        streams = [asyncio.ensure_future(drain(group.generate(request(i)))) for i in range(4)]
        await asyncio.sleep(0.05)
        assert (len(local.requests), len(remote.server.requests)) == (2, 2)  # least-loaded routing
        local.gate.set()
        remote.server.gate.set()
        outputs = await asyncio.gather(*streams)
        stats = await group.stats()
        return outputs, stats

    outputs, stats = asyncio.run(scenario())
    assert all([d.token_ids for d in out] == [[1], [2]] for out in outputs)
    assert stats.started_total == 4 and [r.started_total for r in stats.ranks] == [2, 2]
    assert stats.kv_transfer == {"leases_outstanding": 1}  # numbers summed, labels dropped
    assert stats.routed_tokens_per_expert == {e: 10 + e % 4 for e in range(8)}


def test_a_dead_rank_fails_every_in_flight_request_of_the_group_and_new_ones_fast():
    async def scenario():
        group, local, (remote,) = make_group()
        local.gate.clear()
        remote.server.gate.clear()
        streams = [asyncio.ensure_future(drain(group.generate(request(i)))) for i in range(2)]
        await asyncio.sleep(0.05)
        remote.dead.set()  # the rank's process died; the survivor is stuck in a collective
        outputs = await asyncio.wait_for(asyncio.gather(*streams), timeout=2)
        late = await drain(group.generate(request(9)))
        health = None
        try:
            await group.check_health()
        except Exception as exc:
            health = exc
        await asyncio.sleep(0.05)  # the broken group stops its surviving engines
        return outputs, late, health, local, remote

    outputs, late, health, local, remote = asyncio.run(scenario())
    assert local.shut_down
    for out in outputs:
        assert isinstance(out[-1], EngineFailure) and out[-1].retriable and "rank 1 died" in out[-1].message
    assert isinstance(late[0], EngineFailure) and late[0].retriable
    assert type(health).__name__ == "GroupBroken"  # Serve replaces the whole group
    assert local.aborted == ["req-0"]  # the stuck request was cancelled in its engine
    assert CANCELLED  # and the remote rank's stream was cancelled too, and aborted by id
    assert remote.server.aborted_by_id == ["req-1"]


def test_group_stats_of_one_rank_is_that_rank():
    one = ServerStats(replica_id="x", started_total=3, in_flight_request_ids=["b", "a"])
    total = group_stats([one], {})
    assert total.started_total == 3 and total.in_flight_request_ids == ["a", "b"] and total.ranks == [one]


def test_a_rank_that_cannot_report_expert_load_leaves_the_other_stats_whole(caplog):
    """An engine whose worker cannot answer the expert RPCs (e.g. an extension missing on its
    platform): its load is an empty mapping, warned about once, and the KV counters stay."""
    async def scenario():
        group, local, (remote,) = make_group()
        remote.server.observation_error = AttributeError("'Worker' object has no attribute 'routed_tokens_per_expert'")
        await drain(group.generate(request(0)))
        first, second = await group.stats(), await group.stats()
        return first, second, await group.placement()

    with caplog.at_level(logging.DEBUG, logger="deployments.expert_parallel.expert_group"):
        first, second, placement = asyncio.run(scenario())
    for stats in (first, second):
        assert stats.kv_transfer == {"leases_outstanding": 1}  # rank 1's KV counter is still summed
        assert [r.routed_tokens_per_expert for r in stats.ranks] == [{e: 10 + e for e in range(4)}, {}]
        assert stats.routed_tokens_per_expert == {e: 10 + e for e in range(4)}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "report routed_tokens_per_expert" in r.getMessage()]
    assert len(warnings) == 1 and "rank 1" in warnings[0].getMessage()  # once, not every export period
    assert placement[0]["layers"] == [{"local_expert_ids": [0]}]
    assert placement[1] == {"process_id": None, "node_id": None, "layers": [], "parameter_bytes": {}}
