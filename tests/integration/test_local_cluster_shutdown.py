"""A stopped local cluster leaves no process behind (cluster/process_tree.py): an actor's child
that left the actor's process group (beyond Ray's own cleanup) and ignores SIGTERM is ended
when the cluster is shut down. Real Ray: its own one-node cluster, in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from tests.integration.conftest import REPO

pytestmark = pytest.mark.integration


def test_stopping_the_cluster_ends_a_child_that_left_its_workers_process_group():
    result = subprocess.run([sys.executable, str(REPO / "tests" / "local_cluster_orphan.py")], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    child_pid = seen["child_pid"]
    # The cluster's Serve mode reached the node's processes, and this driver did not keep it (in
    # throughput mode a synchronous handle call from a driver fails: no event loop).
    assert seen["node_mode"] == "1" and seen["driver_mode"] is None, seen
    assert "ended 1 process(es) left running" in result.stderr, result.stderr[-3000:]
    try:
        alive = psutil.Process(child_pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        alive = False
    assert not alive, f"pid {child_pid} outlived the cluster"
