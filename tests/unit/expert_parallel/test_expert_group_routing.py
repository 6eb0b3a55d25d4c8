"""Which rank of an expert-parallel group takes a request, when the group follows its ranks'
prefix caches (pools with `prefix` routing and prefix caching): pure rules on hand-made rank
states, then the group itself with fake ranks that report what their caches hold."""

from __future__ import annotations

import asyncio

import pytest

from deployments.expert_parallel.expert_group import ExpertParallelGroup
from deployments.expert_parallel.expert_ranks import (RANK_AFFINITY_SLACK, leading_hits, merge_routing_stats,
                                                      pick_rank)
from deployments.records import EngineRequest, SamplingSpec
from deployments.routing.block_hashes import prompt_block_hashes
from tests.unit.ingress_fakes import FakeMetricsBackend
from tests.unit.expert_parallel.test_expert_group import ENGINE, FakeRankActor, FakeServer, _Method, drain

BLOCK = 4


def test_the_rank_holding_the_longer_prefix_wins_within_the_slack():
    assert pick_rank([0, 0], [0, 3]) == 1
    assert pick_rank([RANK_AFFINITY_SLACK, 0], [5, 0]) == 0  # busier, but within the slack
    assert pick_rank([RANK_AFFINITY_SLACK + 1, 0], [5, 0]) == 1  # beyond it: load wins
    assert pick_rank([1, 0, 0], [2, 2, 0]) == 1  # equal hits: the less loaded
    assert pick_rank([0, 0, 0], [2, 2, 0]) == 0  # then the lower rank
    assert pick_rank([1, 1], [0, 0]) == 0 and pick_rank([1, 0], None) == 1  # no cache view: least loaded
    with pytest.raises(ValueError):
        pick_rank([0, 0], [1])


def test_only_leading_blocks_count_as_hits():
    prompt = prompt_block_hashes(list(range(16)), BLOCK)
    assert leading_hits(prompt, set(prompt)) == 4
    assert leading_hits(prompt, {prompt[0], prompt[2], prompt[3]}) == 1  # block 1 missing: 2, 3 unusable
    assert leading_hits(prompt, set()) == 0 and leading_hits((), {1}) == 0


def test_the_group_report_sums_load_unites_caches_and_changes_epoch_with_any_rank():
    ranks = [{"epoch": "a", "in_flight": 2, "waiting": 1, "kv_usage": 0.2, "at_s": 10.0, "block_size": 4,
              "resident": [1, 2], "prompt_tokens_pending": 900},
             {"epoch": "b", "in_flight": 1, "waiting": 0, "kv_usage": 0.4, "at_s": 9.0, "block_size": 4,
              "resident": [2, 3], "prompt_tokens_pending": 100}]
    merged = merge_routing_stats(ranks)
    assert merged == {"epoch": "group[a,b]", "in_flight": 3, "waiting": 1, "kv_usage": pytest.approx(0.3),
                      "at_s": 9.0, "block_size": 4, "resident": [1, 2, 3], "prompt_tokens_pending": 1000}
    restarted = merge_routing_stats([ranks[0], {**ranks[1], "epoch": "c", "resident": []}])
    assert restarted["epoch"] != merged["epoch"] and restarted["resident"] == [1, 2]
    silent = merge_routing_stats([ranks[0], None])  # a rank that did not answer in time
    assert silent["epoch"] == "group[a,?]" and silent["in_flight"] == 2 and silent["resident"] == [1, 2]
    assert "resident" not in merge_routing_stats([{"epoch": "x", "in_flight": 0}])  # caches not followed


class CachingServer(FakeServer):
    """A FakeServer whose prefix cache holds every full block of the prompts it served, and
    reports it as LLMServer.record_routing_stats does."""

    def __init__(self, *args, kv_events=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.kv_events = kv_events
        self.resident: list[int] = []

    async def generate(self, request):
        self.resident += prompt_block_hashes(request.prompt_token_ids, BLOCK)
        async for item in super().generate(request):
            yield item

    def record_routing_stats(self):
        return {"epoch": f"rank{self.rank}", "in_flight": 0, "at_s": 1.0, "block_size": BLOCK,
                "resident": list(self.resident)}


def make_caching_group():
    remotes = []

    def remote_factory(rank, model, engine, model_path, kv_transfer, **kwargs):
        actor = FakeRankActor(CachingServer(model, engine, model_path, kv_transfer, rank=rank, **kwargs))
        actor.record_routing_stats = _Method(_as_coroutine(actor.server.record_routing_stats))
        remotes.append(actor)
        return actor

    local = []
    group = ExpertParallelGroup({"name": "m"}, ENGINE, "/ckpt", None, {"size": 2, "rank_failure_timeout_s": 1.0},
                                {}, "cpu", pool_name="decode", remote_rank_factory=remote_factory,
                                local_server_factory=lambda *a, **k: local.append(CachingServer(*a, **k)) or local[-1],
                                metrics_backend=FakeMetricsBackend(), cancel_remote=lambda refs: None, kv_events=True)
    return group, local[0], remotes[0].server


def _as_coroutine(fn):
    async def call(*args):
        return fn(*args)
    return call


def prompt_request(name: str, tokens: list[int]) -> EngineRequest:
    return EngineRequest(name, tokens, SamplingSpec(max_tokens=2))


def test_a_repeated_prompt_goes_to_the_rank_that_cached_it_not_to_the_least_loaded_lowest():
    document_a, document_b = list(range(100, 116)), list(range(200, 216))

    async def scenario():
        group, rank0, rank1 = make_caching_group()
        assert rank0.kv_events and rank1.kv_events  # every rank follows its engine's KV events
        rank0.gate.clear()  # hold A on rank 0 so that B goes to rank 1
        first_a = asyncio.ensure_future(drain(group.generate(prompt_request("a", document_a))))
        await asyncio.sleep(0.02)
        await drain(group.generate(prompt_request("b", document_b)))
        rank0.gate.set()
        await first_a
        report = await group.record_routing_stats()
        # Both idle now: least-loaded-lowest would send B's follow-up to rank 0, which lacks it.
        await drain(group.generate(prompt_request("b2", document_b + [7, 7])))
        await drain(group.generate(prompt_request("a2", document_a + [8])))
        return report, rank0.requests, rank1.requests

    report, on_rank0, on_rank1 = asyncio.run(scenario())
    assert set(report["resident"]) == set(prompt_block_hashes(document_a, BLOCK) + prompt_block_hashes(document_b, BLOCK))
    assert on_rank0 == ["a", "a2"] and on_rank1 == ["b", "b2"]


def test_without_kv_events_the_ranks_are_not_asked_to_follow_them():
    seen = []

    def remote_factory(rank, model, engine, model_path, kv_transfer, **kwargs):
        seen.append(kwargs)
        return FakeRankActor(FakeServer(model, engine, model_path, kv_transfer, rank=rank, **kwargs))

    ExpertParallelGroup({"name": "m"}, ENGINE, "/ckpt", None, {"size": 2}, {}, "cpu", remote_rank_factory=remote_factory,
                        local_server_factory=FakeServer, metrics_backend=FakeMetricsBackend())
    assert "kv_events" not in seen[0]
