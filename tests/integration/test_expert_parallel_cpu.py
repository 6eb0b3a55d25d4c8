"""Data-parallel attention + expert-parallel MoE on CPU (2 ranks, 2 processes) with our
compatibility shim: each rank holds only its half of the routed experts, and greedy outputs are
token-identical to one plain vLLM engine. (Engine groups as Serve deployments come next.)

Both sides run in float32: expert parallelism sums the experts' outputs across ranks with an
all-reduce, in another order than one engine does, and in bfloat16 that rounding difference
flips a greedy choice after ~16 tokens of this random model. In float32 the sums agree to the
last token; the comparison itself stays exact."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.integration.conftest import REPO
from tests.prompt_set import COMPLETION_PROMPTS

# Extended tier (docs/testing.md): ~3 minutes; every default-tier test on the session's
# application runs a 2-rank expert-parallel decode group against plain vLLM's outputs.
pytestmark = [pytest.mark.integration, pytest.mark.extended]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def float32_reference(tmp_path_factory) -> dict:
    from cluster.checkpoints import ensure_checkpoint

    out = tmp_path_factory.mktemp("reference-fp32") / "outputs.json"
    subprocess.run([sys.executable, str(REPO / "tests" / "reference_engine.py"),
                    str(ensure_checkpoint("tiny-qwen3-moe", quiet=True)), str(out), "--dtype", "float32"],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return json.loads(out.read_text())


def test_two_rank_expert_parallel_group_matches_plain_vllm(tmp_path, float32_reference):
    from cluster.checkpoints import ensure_checkpoint

    reference_outputs = float32_reference
    model = str(ensure_checkpoint("tiny-qwen3-moe", quiet=True))
    port = _free_port()
    # Rank 0 serves two prompts, rank 1 one: uneven batches exercise the variable-size collectives.
    assignments = {0: ["short", "question"], 1: ["question"]}
    procs = {
        rank: subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "ep_rank.py"), str(rank), "2", str(port), model, "float32",
             str(tmp_path / f"rank{rank}.json"), *(COMPLETION_PROMPTS[n] for n in names)],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for rank, names in assignments.items()
    }
    try:
        errors = {rank: proc.communicate(timeout=600)[1] for rank, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    results = {}
    for rank, names in assignments.items():
        out = tmp_path / f"rank{rank}.json"
        assert out.exists(), f"rank {rank} wrote nothing:\n{errors[rank][-3000:]}"
        results[rank] = json.loads(out.read_text())
        for name, token_ids in zip(names, results[rank]["outputs"]):
            assert token_ids == reference_outputs[name]["token_ids"], (rank, name)

    held = {rank: {tuple(layer["local_expert_ids"]) for layer in r["experts"]} for rank, r in results.items()}
    assert held == {0: {(0, 1, 2, 3)}, 1: {(4, 5, 6, 7)}}  # 8 experts, every layer split the same way
    assert all(layer["ep_size"] == 2 and layer["local_num_experts"] == 4
               for r in results.values() for layer in r["experts"])
