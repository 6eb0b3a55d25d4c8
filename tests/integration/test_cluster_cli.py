"""The CLI and `ray job submit` against the running multi-node stack."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import REPO

pytestmark = pytest.mark.integration


def test_nodes_carry_role_labels_and_replicas_sit_on_their_nodes(stack):
    import ray

    nodes = {n["NodeID"]: n["Labels"].get("moe-role") for n in ray.nodes() if n["Alive"]}
    assert sorted(nodes.values()) == ["decode", "decode", "head", "prefill"]
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE")], detail=True)
    roles = {a.class_name: nodes[a.node_id] for a in actors if a.class_name.startswith("ServeReplica:")}
    assert roles == {"ServeReplica:moe-local:prefill": "prefill", "ServeReplica:moe-local:decode": "decode",
                     "ServeReplica:moe-local:openai-ingress": "head"}
    # The decode replica is rank 0 of its expert-parallel group; rank 1 runs on the other decode node.
    (rank1,) = [a for a in actors if a.class_name == "LLMServer"]
    assert nodes[rank1.node_id] == "decode"
    decode_rank0 = next(a for a in actors if a.class_name == "ServeReplica:moe-local:decode")
    assert rank1.node_id != decode_rank0.node_id


def test_status_through_ray_job_submit(stack):
    result = subprocess.run(
        [str(Path(sys.executable).parent / "ray"), "job", "submit", "--address", stack.dashboard_url,
         "--working-dir", str(REPO), "--", "moe-serve", "status"],
        capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "RAY_AUTH_MODE": "token"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "application moe-local: RUNNING" in result.stdout
    assert "prefill" in result.stdout and "decode" in result.stdout and "HEALTHY" in result.stdout
