"""cluster/process_tree.py on real processes: a child that outlives its killed parent (as vLLM's
DP coordinator outlives a Ray worker whose raylet is gone) is found from the tree noted before
the kill and ended; a process already gone is skipped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from cluster.process_tree import end_survivors, process_tree

# A parent that starts a child which ignores SIGTERM and never watches its parent.
PARENT = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, maybe later)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _start_parent_with_child() -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    return parent, child_pid


def test_an_orphan_of_a_killed_parent_is_ended_even_if_it_ignores_sigterm():
    parent, child_pid = _start_parent_with_child()
    try:
        noted = process_tree([parent.pid])
        assert {p.pid for p in noted} == {parent.pid, child_pid}
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        assert _running(child_pid)  # orphaned, still running: what a killed raylet leaves

        ended = end_survivors(noted, exit_wait_s=0.5, grace_s=0.5)

        assert len(ended) == 1 and ended[0].endswith(f"(pid {child_pid})"), ended
        assert not _running(child_pid)  # SIGTERM ignored: killed after the grace period
    finally:
        for pid in (parent.pid, child_pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_processes_already_gone_are_skipped_and_nothing_is_reported():
    short = subprocess.Popen([sys.executable, "-c", "pass"])
    noted = process_tree([short.pid])
    short.wait(timeout=10)
    assert end_survivors(noted, exit_wait_s=0.1, grace_s=0.1) == []
    assert process_tree([short.pid]) == []  # a pid that no longer exists has no tree
