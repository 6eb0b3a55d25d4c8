"""Expert shards on the real stack: the default manifest's decode pool is a 2-rank
expert-parallel group (one rank on decode-0, one on decode-1) behind the prefill pool."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.prompt_set import MAX_TOKENS, concurrent_prompts

pytestmark = pytest.mark.integration


def _decode_handle(stack):
    from ray import serve

    return serve.get_deployment_handle("decode", app_name=stack.app_name)


def test_each_rank_runs_on_its_own_node_and_holds_only_its_half_of_the_experts(stack):
    ranks = _decode_handle(stack).placement.remote().result(timeout_s=60)
    assert len(ranks) == 2
    assert ranks[0]["node_id"] != ranks[1]["node_id"]  # STRICT_SPREAD over decode-0 and decode-1
    assert ranks[0]["process_id"] != ranks[1]["process_id"]
    for rank, placement in enumerate(ranks):
        assert len(placement["layers"]) == 4  # every MoE layer of the tiny model
        for layer in placement["layers"]:
            assert (layer["ep_rank"], layer["ep_size"], layer["global_num_experts"]) == (rank, 2, 8)
            assert layer["local_expert_ids"] == list(range(4 * rank, 4 * rank + 4))


def test_16_concurrent_requests_through_the_expert_parallel_group_are_token_identical(
        stack, reference_outputs, engine_stats):
    before = engine_stats("decode")
    prompts = dict(list(concurrent_prompts(32).items())[:16])

    async def run_all():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32)) as client:
            async def one(name):
                response = await client.post(f"{stack.base_url}/v1/completions", json={
                    "model": stack.model, "prompt": prompts[name], "max_tokens": MAX_TOKENS, "temperature": 0,
                    "return_token_ids": True})
                assert response.status_code == 200, response.text
                return name, response.json()["choices"][0]["token_ids"]
            return await asyncio.gather(*(one(n) for n in prompts))

    for name, token_ids in asyncio.run(run_all()):
        assert token_ids == reference_outputs[name]["token_ids"], name
    after = engine_stats("decode")
    # Both ranks took requests (least-loaded routing), and each rank's experts did work.
    started = [a.started_total - b.started_total for a, b in zip(after.ranks, before.ranks)]
    assert len(started) == 2 and sum(started) == 16 and min(started) >= 4, started
    assert set(after.ranks[0].routed_tokens_per_expert) == {0, 1, 2, 3}
    assert set(after.ranks[1].routed_tokens_per_expert) == {4, 5, 6, 7}
    grew = {e: after.routed_tokens_per_expert[e] - before.routed_tokens_per_expert.get(e, 0) for e in range(8)}
    assert all(tokens > 0 for tokens in grew.values()), grew


def test_expert_load_reaches_prometheus_format_through_rays_metrics(stack, engine_stats):
    """moe_serve_expert_routed_tokens_total{pool,rank,expert} on the Ray metrics endpoints."""
    from tests.integration.conftest import TEST_METRICS_BASE
    from tests.metrics_text import samples

    engine_stats("decode")  # exports the current counts
    deadline = time.monotonic() + 60
    seen: set[tuple[str, str]] = set()
    while time.monotonic() < deadline and len(seen) < 8:
        for port in range(TEST_METRICS_BASE, TEST_METRICS_BASE + 4):
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            for sample in samples(text, "ray_moe_serve_expert_routed_tokens_total", pool="decode"):
                seen.add((sample.labels["rank"], sample.labels["expert"]))
        time.sleep(2)
    assert seen == {(str(e // 4), str(e)) for e in range(8)}
