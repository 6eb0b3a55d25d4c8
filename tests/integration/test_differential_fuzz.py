"""Differential fuzz on the real stack: a few hundred seeded bodies (benchmarks/fuzz_bodies.py)
to the session's application (P/D + expert-parallel decode, real engines) and to vLLM's own
OpenAI server on the same checkpoint. Every status-class difference must be one we listed with
its reason (benchmarks/fuzz_vs_vllm.py DELIBERATE), and we answer no body with a 5xx.

The FakeEngine fuzz (tests/unit/frontend/test_openai_ingress_fuzz.py) covers the ingress alone; this one
reaches the engines, whose own validation (logprob counts, token ids against the vocabulary)
a fake cannot show. benchmarks/fuzz_vs_vllm.py runs the same with thousands of bodies."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from benchmarks.fuzz_bodies import GENERATION_ROUTES
from benchmarks.fuzz_vs_vllm import ask_all, compare, summarize

pytestmark = pytest.mark.integration


def _log(message: str) -> None:
    print(f"[fuzz] {message}", file=sys.stderr, flush=True)


def test_every_status_class_difference_from_vllm_is_listed_and_none_is_a_5xx(stack, plain_vllm_answers):
    """vLLM's answers were recorded while its server was up (conftest's plain_vllm_answers);
    the same bodies, byte for byte, go to our stack now."""
    vllm = plain_vllm_answers
    started = time.monotonic()
    ours = asyncio.run(ask_all(vllm.fuzz_bodies, stack.base_url, concurrency=4))
    records = compare(vllm.fuzz_bodies, ours, vllm.fuzz_answers, vllm.checkpoint)
    summary = summarize(records)
    _log(f"{len(records)} bodies in {time.monotonic() - started:.0f}s: {summary['agreement_pct']}% same class, "
         f"deliberate {summary['deliberate']}, 5xx ours/vLLM {summary['ours_5xx']}/{summary['vllm_5xx']}")
    # The bodies must reach the engines, or the comparison says nothing about them.
    generated = sum(r.ours.outcome == r.vllm.outcome == "2xx" for r in records if r.body.path in GENERATION_ROUTES)
    assert generated >= len(records) // 5, f"only {generated} bodies generated on both servers: {summary['differences']}"
    failures = "\n".join(f"{f['count']} x {f['kind']}\n    ours: {f['example']['ours']}\n    vLLM: "
                         f"{f['example']['vllm']}\n    body: {f['example']['path']} {f['example']['preview']}"
                         for f in summary["failure_kinds"])
    assert summary["failures"] == 0, f"{summary['failures']} unlisted differences or 5xx answers:\n{failures}"
