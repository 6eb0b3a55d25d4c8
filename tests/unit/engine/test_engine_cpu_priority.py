"""CPU engines run at niceness 19 (below the request path), GPU engines keep Ray's, and the
manifest's engine.nice wins; every thread of the process is set, and children inherit it."""

import json
import os
import subprocess
import sys
import threading

import pytest

from cluster.manifest import EngineSpec
from deployments.engine.cpu_priority import CPU_ENGINE_NICENESS, engine_niceness, set_process_niceness

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_cpu_engines_yield_gpu_engines_keep_rays_and_the_manifest_wins():
    assert engine_niceness(None, on_cpu=True) == CPU_ENGINE_NICENESS == 19
    assert engine_niceness(None, on_cpu=False) is None
    assert engine_niceness(0, on_cpu=True) == 0
    assert engine_niceness(17, on_cpu=False) == 17


@pytest.mark.parametrize("bad", [-1, 20])
def test_the_manifest_refuses_a_niceness_linux_does_not_have(bad):
    with pytest.raises(ValueError, match="nice"):
        EngineSpec(nice=bad)


def test_every_thread_and_every_later_child_gets_the_niceness():
    # In a child interpreter: this test process must keep its own priority.
    script = """
import json, os, subprocess, sys, threading
from deployments.engine.cpu_priority import set_process_niceness
started, stop = threading.Event(), threading.Event()
def idle():
    started.set(); stop.wait()
thread = threading.Thread(target=idle); thread.start(); started.wait()
changed = set_process_niceness(18)
tids = [int(t) for t in os.listdir("/proc/self/task")]
threads = {os.getpriority(os.PRIO_PROCESS, t) for t in tids}
child = subprocess.run([sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"],
                       capture_output=True, text=True, check=True).stdout.strip()
again = set_process_niceness(18)
stop.set(); thread.join()
print(json.dumps({"changed": changed, "threads": sorted(threads), "child": int(child), "again": again}))
"""
    out = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                                    cwd=REPO).stdout)
    assert out["changed"] >= 2  # the main thread and the idle one
    assert out["threads"] == [18]
    assert out["child"] == 18  # vLLM's engine-core and workers start after: they inherit it
    assert out["again"] == 0  # already there: nothing to change


def test_none_changes_nothing():
    before = os.getpriority(os.PRIO_PROCESS, 0)
    assert set_process_niceness(None) == 0
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_without_the_right_to_raise_priority_the_engine_keeps_its_own(monkeypatch, caplog):
    def refuse(which, who, value):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    current = os.getpriority(os.PRIO_PROCESS, 0)
    target = current - 1 if current > 0 else current + 1
    assert set_process_niceness(target) == 0
    assert "CAP_SYS_NICE" in caplog.text


def test_a_thread_that_ended_meanwhile_is_skipped(tmp_path, monkeypatch):
    (tmp_path / str(threading.get_native_id())).mkdir()
    (tmp_path / "999999999").mkdir()  # no such thread
    calls = []
    monkeypatch.setattr(os, "setpriority", lambda which, who, value: calls.append(who))
    set_process_niceness(os.getpriority(os.PRIO_PROCESS, 0) + 1, tasks_dir=str(tmp_path))
    assert calls == [threading.get_native_id()]
