"""Tensor parallel 2 with our KV connector on the real vLLM CPU build (issue 28).

Two TP=2 engine servers (prefill and decode, four vLLM workers in all) in a subprocess
(tests/tp_disagg_engines.py): every worker serves its shard of the KV on its own port, each
decode rank pulls from the prefill rank of its number, and greedy output is token-identical to
one plain TP=1 vLLM engine on the same checkpoint. failure_policy is "fail" there, so a pull
that failed would fail the request instead of recomputing it unnoticed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.conftest import DEFAULT_MANIFEST, REPO

pytestmark = pytest.mark.integration

TP = 2


def test_tp2_prefill_decode_is_token_identical_and_every_rank_moves_its_shard(tmp_path, reference_outputs):
    from cluster.checkpoints import resolve_model_path
    from cluster.manifest import load_manifest

    manifest = load_manifest(DEFAULT_MANIFEST)
    out, log = tmp_path / "tp.json", tmp_path / "tp.log"
    with open(log, "wb") as stderr:
        code = subprocess.run(
            [sys.executable, str(REPO / "tests" / "tp_disagg_engines.py"), str(resolve_model_path(manifest.model.path)),
             str(out), "--tp", str(TP), "--max-model-len", str(manifest.model.max_model_len),
             "--dtype", manifest.model.dtype], cwd=REPO, stdout=stderr, stderr=stderr, timeout=900).returncode
    assert code == 0, log.read_text(errors="replace")[-3000:]
    result = json.loads(out.read_text())

    for name, token_ids in result["outputs"].items():
        assert token_ids == reference_outputs[name]["token_ids"], name
        assert result["cached_tokens"][name] > 0, name  # decode computed only what it did not pull
    ports = result["rank_ports"]
    assert all(p == list(range(p[0], p[0] + TP)) for p in ports.values())  # one KV port per rank
    decode, prefill = result["decode_kv"], result["prefill_kv"]
    prompts = len(result["outputs"])
    assert (decode["pulls_succeeded_total"], decode["pulls_failed_total"]) == (prompts, 0)
    # Each decode rank pulled its own shard from its own prefill rank, and released it there.
    shards = [rank["bytes_loaded_total"] for rank in result["per_rank"]["decode"]]
    assert all(rank["pulls_succeeded_total"] == prompts for rank in result["per_rank"]["decode"])
    assert shards[0] > 0 and len(set(shards)) == 1  # equal shards (heads split evenly, or MLA replicated)
    assert decode["bytes_loaded_total"] == sum(shards)  # the engine's stats: every rank's bytes
    assert all(rank["leases_released_total"] == prompts for rank in result["per_rank"]["prefill"])
    assert (prefill["leases_granted_total"], prefill["leases_released_total"]) == (prompts, prompts)
    assert (prefill["leases_outstanding"], prefill["leases_expired_total"]) == (0, 0)
