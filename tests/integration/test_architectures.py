"""DeepSeek-V3 (MLA) and GLM-4.5 (GQA, partial rotary) layouts through our stack, on the
session's cluster as a second application beside the default one:

1. P/D with an expert-parallel decode group (manifests/local-deepseek.yaml, local-glm.yaml as
   committed): prompt KV crosses nodes through our connector (MLA: one latent page per block
   and layer), decode's two ranks each hold half of the routed experts;
2. DeepSeek-V3 colocated on one 2-rank expert-parallel group (prefill and decode in the group,
   no connector). GLM-4.5 skips this second deployment (about five minutes of CI): its GQA
   layout under a colocated EP group is the path the default Qwen3-MoE application already
   proves token-identical, and its P/D + EP run above covers its router and rotary layout.

Greedy outputs through HTTP must equal one plain vLLM engine's on the same checkpoint, and
the connector's counters must show that every prompt block came over the wire.

Requests are sent one at a time and the reference runs each prompt alone, so a failure names
one request. (Until deployments/engine/vllm_cpu_mla_fix.py, vLLM 0.32's CPU rotary kernel mis-rotated
MLA's 3-D views: DeepSeek-V3 outputs depended on the batch, and P/D, which loads the prompt's
KV and computes only its last token, diverged from a plain prefill; docs/architectures.md.)
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.conftest import REPO, TEST_HTTP_PORT, ReferenceRun, deploy_test_app, remove_test_app
from tests.prompt_set import CHAT_CONVERSATIONS, COMPLETION_PROMPTS, MAX_TOKENS

pytestmark = pytest.mark.integration

MODELS = {
    # manifest, KV block size (vLLM forces 16 for MLA on CPU; 128 is the CPU default), KV bytes/token
    "tiny-deepseek-v3": ("local-deepseek.yaml", 16, 4 * 576 * 4),
    "tiny-glm4-moe": ("local-glm.yaml", 128, 2 * 4 * 2 * 32 * 4),
}


def _log(message: str) -> None:
    print(f"[architectures] {message}", file=sys.stderr, flush=True)


# The completion prompts these tests send (with every chat conversation): the reference runs only
# these, one at a time, instead of the whole set with its 32 concurrency prompts.
REFERENCE_PROMPTS = ("short", "question", "long")


def _reference(model_path: Path, out: Path, dtype: str, model: str) -> ReferenceRun:
    reference = ReferenceRun([str(model_path), str(out), "--dtype", dtype, "--one-at-a-time",
                              "--prompts", ",".join(REFERENCE_PROMPTS)], out, model)
    reference.outputs()  # before the deploy: the two side by side only slowed each other
    return reference


def _manifest_data(model: str, colocated: bool, pool: bool = False, prefix_routing: bool = False) -> dict:
    data = yaml.safe_load((REPO / "manifests" / MODELS[model][0]).read_text())
    data["name"] = "arch-" + model.removeprefix("tiny-")
    data["http"]["port"] = TEST_HTTP_PORT
    data["http"]["route_prefix"] = "/" + data["name"]
    if colocated:
        decode = next(p for p in data["pools"] if p["role"] == "decode")
        data["pools"] = [{**decode, "name": "engine", "role": "colocated"}]
        data["pools"][0]["engine"]["enable_prefix_caching"] = True
        if prefix_routing:  # the group follows its ranks' KV events (GQA: vLLM's CPU MLA has no prefix cache)
            data["pools"][0]["routing"] = {"policy": "prefix"}
    if pool:  # P/D of single engines sharing the KV pool (the default app's cores stay free)
        next(p for p in data["pools"] if p["role"] == "decode").pop("expert_parallel", None)
        data["kv_pool"] = {"enabled": True, "segment_mib": 64, "local_buffer_mib": 16}
    return data


class ArchStack:
    def __init__(self, stack, model: str, reference: ReferenceRun):
        self.model, self.stack = model, stack
        self._reference = reference
        self.app = None
        self.base_url = None

    @property
    def reference(self) -> dict:
        return self._reference.outputs()

    def deploy(self, colocated: bool, pool: bool = False, prefix_routing: bool = False) -> None:
        data = _manifest_data(self.model, colocated, pool, prefix_routing)
        self.app = data["name"]
        started = time.monotonic()
        deploy_test_app(data, f"{self.model} manifest")
        self.base_url = f"http://127.0.0.1:{TEST_HTTP_PORT}{data['http']['route_prefix']}"
        _log(f"{self.app} ({'colocated EP group' if colocated else 'P/D + EP decode'}) up in "
             f"{time.monotonic() - started:.0f}s")

    def stats(self, pool: str):
        from ray import serve

        return serve.get_deployment_handle(pool, app_name=self.app).stats.remote().result(timeout_s=30)

    def complete(self, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
        response = httpx.post(f"{self.base_url}/v1/completions", timeout=120, json={
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True})
        assert response.status_code == 200, response.text
        return response.json()


# GLM-4.5 is in the extended tier (docs/testing.md: ~6 minutes of CI for its two deployments):
# its GQA pages cross the connector as the default Qwen3-MoE application's do, and
# test_checkpoints_load.py loads its checkpoint in vLLM's real loader in the default tier.
@pytest.fixture(scope="module", params=["tiny-deepseek-v3",
                                        pytest.param("tiny-glm4-moe", marks=pytest.mark.extended)])
def arch(request, stack, tmp_path_factory):
    from cluster.checkpoints import resolve_model_path

    model = request.param
    manifest = yaml.safe_load((REPO / "manifests" / MODELS[model][0]).read_text())
    _log(f"reference outputs of {model} (one prompt at a time)")
    reference = _reference(resolve_model_path(manifest["model"]["path"]),
                           tmp_path_factory.mktemp("ref") / "outputs.json", manifest["model"]["dtype"], model)
    arch_stack = ArchStack(stack, model, reference)
    try:
        arch_stack.deploy(colocated=False)
        yield arch_stack
    finally:
        reference.stop()
        if arch_stack.app:
            remove_test_app(arch_stack.app)


def _outputs(arch_stack: ArchStack) -> dict[str, list[int]]:
    """Greedy token ids per reference name: short, ~1,260-token long, two chats, streamed long."""
    out = {}
    for name in REFERENCE_PROMPTS:
        body = arch_stack.complete(COMPLETION_PROMPTS[name])
        assert body["prompt_token_ids"] == arch_stack.reference[name]["prompt_token_ids"], name
        out[name] = body["choices"][0]["token_ids"]
    assert len(arch_stack.reference["long"]["prompt_token_ids"]) >= 512
    for name, messages in CHAT_CONVERSATIONS.items():
        response = httpx.post(f"{arch_stack.base_url}/v1/chat/completions", timeout=120, json={
            "model": arch_stack.model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        assert response.status_code == 200, response.text
        out[name] = response.json()["choices"][0]["token_ids"]
    streamed: list[int] = []
    with httpx.stream("POST", f"{arch_stack.base_url}/v1/completions", timeout=120, json={
            "model": arch_stack.model, "prompt": COMPLETION_PROMPTS["long"], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "return_token_ids": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += [t for c in json.loads(line[6:])["choices"] for t in c.get("token_ids", [])]
    out["long (streamed)"] = streamed
    return out


def _expected(arch_stack: ArchStack, name: str) -> list[int]:
    return arch_stack.reference[name.removesuffix(" (streamed)")]["token_ids"]


def _assert_identical(arch_stack: ArchStack, outputs: dict[str, list[int]]) -> None:
    for name, token_ids in outputs.items():
        assert token_ids == _expected(arch_stack, name), name


def _settled(arch_stack: ArchStack, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        prefill, decode = arch_stack.stats("prefill"), arch_stack.stats("decode")
        if (prefill.kv_transfer["leases_outstanding"] == 0 and decode.kv_transfer["pulls_in_flight"] == 0) \
                or time.monotonic() > deadline:
            return prefill, decode
        time.sleep(0.2)


def test_pd_with_ep_decode_is_token_identical_and_every_prompt_block_is_pulled(arch):
    _, block_tokens, kv_bytes_per_token = MODELS[arch.model]
    before_p, before_d = (s.kv_transfer for s in _settled(arch))
    outputs = _outputs(arch)
    prefill, decode = _settled(arch)
    p, d = prefill.kv_transfer, decode.kv_transfer
    # Every request was disaggregated: prompt blocks per request, summed (chat prompts come from
    # the reference's prompt ids; the streamed long prompt once more).
    prompts = [arch.reference[n]["prompt_token_ids"] for n in ("short", "question", "long", *CHAT_CONVERSATIONS, "long")]
    expected_blocks = sum(math.ceil(len(ids) / block_tokens) for ids in prompts)
    assert d["pulls_succeeded_total"] - before_d["pulls_succeeded_total"] == len(prompts)
    assert d["pulls_failed_total"] == before_d["pulls_failed_total"]
    assert d["fallbacks_total"] == before_d["fallbacks_total"]  # no silent recompute
    assert d["blocks_loaded_total"] - before_d["blocks_loaded_total"] == expected_blocks
    assert p["blocks_leased_total"] - before_p["blocks_leased_total"] == expected_blocks
    # A page is block_tokens x the per-token KV of every layer: MLA moves one latent, GQA K and V.
    assert d["bytes_loaded_total"] - before_d["bytes_loaded_total"] == expected_blocks * block_tokens * kv_bytes_per_token
    assert p["leases_outstanding"] == 0 and p["leases_expired_total"] == before_p["leases_expired_total"]
    _assert_identical(arch, outputs)


def test_ep_decode_ranks_hold_disjoint_halves_and_route_through_the_real_router(arch):
    stats = arch.stats("decode")
    assert len(stats.ranks) == 2
    held = [set(rank.routed_tokens_per_expert) for rank in stats.ranks]
    assert held[0] <= {0, 1, 2, 3} and held[1] <= {4, 5, 6, 7}
    # Grouped top-2 with a correction bias still spreads tokens over both ranks' experts.
    assert held[0] and held[1]
    assert stats.routed_tokens_per_expert == {
        **stats.ranks[0].routed_tokens_per_expert, **stats.ranks[1].routed_tokens_per_expert}


@pytest.mark.extended  # a third DeepSeek deployment (~2 min); P/D above already runs MLA in an EP group
@pytest.mark.parametrize("arch", ["tiny-deepseek-v3"], indirect=True)
def test_colocated_ep_group_is_token_identical(arch):
    """MLA, grouped sigmoid routing with its bias and shared experts under expert parallelism:
    no connector involved, so DeepSeek-V3 must match exactly too."""
    arch.deploy(colocated=True)
    _assert_identical(arch, _outputs(arch))


@pytest.mark.extended
@pytest.mark.parametrize("arch", ["tiny-glm4-moe"], indirect=True)
def test_a_colocated_ep_group_sends_a_follow_up_to_the_rank_that_cached_its_prefix(arch):
    """Prefix routing on an expert-parallel pool: each rank follows its engine's KV events, the
    group reports what its ranks hold and sends a request to the rank holding its prefix. Two
    documents land on different ranks (the first is still running when the second arrives);
    follow-ups sent one at a time then go back to the rank that holds their document, where a
    group choosing the least loaded rank would send both to rank 0."""
    from concurrent.futures import ThreadPoolExecutor

    arch.deploy(colocated=True, prefix_routing=True)
    documents = [f"Chapter {i} of the keeper's log. " + "the lamp was lit at dusk and kept till dawn " * 30
                 for i in range(2)]

    def started() -> list[int]:
        return [rank.started_total for rank in arch.stats("engine").ranks]

    before = started()
    with ThreadPoolExecutor(2) as threads:
        held = threads.submit(arch.complete, documents[0], 96)  # long enough to be in flight when the next arrives
        time.sleep(0.5)
        threads.submit(arch.complete, documents[1]).result()
        assert len(held.result()["prompt_token_ids"]) >= 3 * 128  # full blocks to find cached
    placed = started()
    assert [a - b for a, b in zip(placed, before)] == [1, 1], (before, placed)
    time.sleep(3)  # the ranks' KV events reach their subscribers; Serve asks the group for its report each second

    arch.complete(documents[1] + " What did the keeper see?")
    after_second = started()
    arch.complete(documents[0] + " And in the morning?")
    after_first = started()
    assert [a - b for a, b in zip(after_second, placed)] == [0, 1], "the follow-up on document 1 left its rank"
    assert [a - b for a, b in zip(after_first, after_second)] == [1, 0], "the follow-up on document 0 left its rank"


def _pool_counters(arch_stack: ArchStack) -> dict[str, dict]:
    """Pool counters of prefill and decode once no store is in flight (two equal reads)."""
    previous = None
    for _ in range(40):
        current = {pool: {k: v for k, v in arch_stack.stats(pool).kv_transfer.items() if k.startswith("pool_")}
                   for pool in ("prefill", "decode")}
        if current == previous:
            break
        previous = current
        time.sleep(0.5)
    return current


@pytest.mark.parametrize("arch", ["tiny-deepseek-v3"], indirect=True)
def test_mla_pages_through_the_kv_pool_are_token_identical(arch):
    """MLA's latent pages in the KV pool: P/D with the pool on both sides. vLLM's CPU MLA backend
    turns its own prefix cache off, so on the second round every full prompt block either engine
    reuses can only have come from the pool."""
    arch.deploy(colocated=False, pool=True)
    _assert_identical(arch, _outputs(arch))  # first round: computed, stored by prefill and decode
    before = _pool_counters(arch)
    assert before["prefill"]["pool_blocks_stored_total"] > 0 and before["prefill"]["pool_up"] == 1
    _assert_identical(arch, _outputs(arch))  # second round: prompt blocks from the pool
    after = _pool_counters(arch)
    block_tokens = MODELS[arch.model][1]
    prompts = [arch.reference[n]["prompt_token_ids"] for n in ("short", "question", "long", *CHAT_CONVERSATIONS, "long")]
    full_blocks = sum(len(ids) // block_tokens for ids in prompts)
    for pool in ("prefill", "decode"):
        loaded = after[pool]["pool_blocks_loaded_total"] - before[pool]["pool_blocks_loaded_total"]
        assert loaded >= 0.9 * full_blocks, (pool, loaded, full_blocks)
        assert after[pool]["pool_load_failures_total"] == before[pool]["pool_load_failures_total"], pool
