"""Differential fuzz on the real stack: a few hundred seeded bodies (benchmarks/fuzz_bodies.py)
to the session's application (P/D + expert-parallel decode, real engines) and to vLLM's own
OpenAI server on the same checkpoint. Every status-class difference must be one we listed with
its reason (benchmarks/fuzz_vs_vllm.py DELIBERATE), and we answer no body with a 5xx.

The FakeEngine fuzz (tests/unit/test_openai_ingress_fuzz.py) covers the ingress alone; this one
reaches the engines, whose own validation (logprob counts, token ids against the vocabulary)
a fake cannot show. benchmarks/fuzz_vs_vllm.py runs the same with thousands of bodies."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import pytest

from benchmarks.fuzz_bodies import GENERATION_ROUTES, generate
from benchmarks.fuzz_vs_vllm import checkpoint_of, run_bodies, summarize

BODIES = 250
SEED = 20261207
PLAIN_SERVER_PORT = 8021  # conftest's feature-comparison server uses 8019
START_TIMEOUT_S = 420


def _log(message: str) -> None:
    print(f"[fuzz] {message}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def plain_vllm(stack, tmp_path_factory):
    """vLLM's OpenAI server on the stack's checkpoint, as users run it (the command of
    conftest's `vllm_feature_answers`), for this module only: (url, model path)."""
    from cluster.checkpoints import resolve_model_path
    from cluster.manifest import load_manifest

    manifest = load_manifest(stack.manifest_path)
    model_path = str(resolve_model_path(manifest.model.path))
    log = tmp_path_factory.mktemp("fuzz-vllm-server") / "server.log"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
               "--served-model-name", stack.model, "--max-model-len", str(manifest.model.max_model_len),
               "--dtype", manifest.model.dtype, "--enforce-eager", "--gpu-memory-utilization", "0.1",
               "--max-num-seqs", "8", "--tool-call-parser", manifest.model.tool_parser, "--enable-auto-tool-choice",
               "--host", "127.0.0.1", "--port", str(PLAIN_SERVER_PORT)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    started = time.monotonic()
    with open(log, "w") as out:
        server = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{PLAIN_SERVER_PORT}"
    try:
        _wait_healthy(url, server, log)
        _log(f"vLLM's server up in {time.monotonic() - started:.0f}s")
        yield url, model_path
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_healthy(url: str, server: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's OpenAI server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(2)


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
