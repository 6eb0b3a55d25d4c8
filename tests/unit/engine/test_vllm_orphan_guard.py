"""The orphan guard: a process that installed it exits once its parent is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# The child starts a grandchild that installs the guard and then sleeps "forever"; the child
# prints the grandchild's pid and exits at once, orphaning it.
CHILD = """
import subprocess, sys
grandchild = subprocess.Popen([sys.executable, "-c",
    "from deployments.engine.vllm_orphan_guard import install; install(); import time; time.sleep(60)"])
print(grandchild.pid, flush=True)
__import__("time").sleep(2.0)  # time for the grandchild to install the guard
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "State:\tZ" not in status.read_text()


def test_an_orphaned_process_exits_within_a_few_seconds():
    child = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=30,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
    grandchild = int(child.stdout.split()[0])
    deadline = time.monotonic() + 6
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(grandchild)
    if alive:
        os.kill(grandchild, 9)
    assert not alive, "the orphaned process kept running"


def test_the_guard_is_registered_as_a_vllm_general_plugin():
    values = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "deployments.engine.vllm_orphan_guard:install" in values
