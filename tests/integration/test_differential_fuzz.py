"""Differential fuzz on the real stack: a few hundred seeded bodies (benchmarks/fuzz_bodies.py)
to the session's application (P/D + expert-parallel decode, real engines) and to vLLM's own
OpenAI server on the same checkpoint. Every status-class difference must be one we listed with
its reason (benchmarks/fuzz_vs_vllm.py DELIBERATE), and we answer no body with a 5xx.

The FakeEngine fuzz (tests/unit/test_openai_ingress_fuzz.py) covers the ingress alone; this one
reaches the engines, whose own validation (logprob counts, token ids against the vocabulary)
a fake cannot show. benchmarks/fuzz_vs_vllm.py runs the same with thousands of bodies."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from benchmarks.fuzz_bodies import GENERATION_ROUTES, generate
from benchmarks.fuzz_vs_vllm import checkpoint_of, run_bodies, summarize
from tests.integration.conftest import plain_vllm_server

BODIES = 250
SEED = 20261207
PLAIN_SERVER_PORT = 8021  # conftest's feature-comparison server uses 8019


def _log(message: str) -> None:
    print(f"[fuzz] {message}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def plain_vllm(stack, tmp_path_factory):
    """vLLM's OpenAI server on the stack's checkpoint, for this module only: (url, model path)."""
    from cluster.checkpoints import resolve_model_path
    from cluster.manifest import load_manifest

    manifest = load_manifest(stack.manifest_path)
    log = tmp_path_factory.mktemp("fuzz-vllm-server") / "server.log"
    with plain_vllm_server(manifest, stack.model, PLAIN_SERVER_PORT, log, "vLLM's server for the fuzz") as url:
        yield url, str(resolve_model_path(manifest.model.path))


def test_every_status_class_difference_from_vllm_is_listed_and_none_is_a_5xx(stack, plain_vllm):
    url, model_path = plain_vllm
    checkpoint = checkpoint_of(model_path)
    bodies = generate(BODIES, SEED, stack.model, checkpoint.vocab_size, checkpoint.tokenizer_size)
    started = time.monotonic()
    records = asyncio.run(run_bodies(bodies, stack.base_url, url, checkpoint, concurrency=4, progress=_log))
    summary = summarize(records)
    _log(f"{len(records)} bodies in {time.monotonic() - started:.0f}s: {summary['agreement_pct']}% same class, "
         f"deliberate {summary['deliberate']}, 5xx ours/vLLM {summary['ours_5xx']}/{summary['vllm_5xx']}")
    # The bodies must reach the engines, or the comparison says nothing about them.
    generated = sum(r.ours.outcome == r.vllm.outcome == "2xx" for r in records if r.body.path in GENERATION_ROUTES)
    assert generated >= BODIES // 5, f"only {generated} bodies generated on both servers: {summary['differences']}"
    failures = "\n".join(f"{f['count']} x {f['kind']}\n    ours: {f['example']['ours']}\n    vLLM: "
                         f"{f['example']['vllm']}\n    body: {f['example']['path']} {f['example']['preview']}"
                         for f in summary["failure_kinds"])
    assert summary["failures"] == 0, f"{summary['failures']} unlisted differences or 5xx answers:\n{failures}"
