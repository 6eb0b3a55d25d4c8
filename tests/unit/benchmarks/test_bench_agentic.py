"""benchmarks/bench_agentic.py's set-up: the four configurations' manifests are valid and differ
only in their pool, and the trace has the sizes the benchmark claims."""

import argparse

from benchmarks.bench_agentic import CONFIGS, app_manifest, make_sessions
from cluster.manifest import parse_manifest


def _args(**overrides) -> argparse.Namespace:
    base = dict(max_model_len=16384, engine_blocks=128, segment_mib=96, disk_gib=2.0, session_idle_s=120.0,
                sessions=3, turns=4, system_tokens=256, message_tokens=100, output_tokens=8)
    return argparse.Namespace(**{**base, **overrides})


def test_the_configurations_differ_only_in_their_pool():
    manifests = {c: parse_manifest(app_manifest(c, _args()), c) for c in CONFIGS}
    for manifest in manifests.values():
        engine = manifest.pools[0].engine
        assert manifest.model.max_model_len == 16384 and engine.extra_args == {"num_gpu_blocks_override": 128}
    assert not manifests["vllm"].kv_pool.enabled and not manifests["pool-off"].kv_pool.enabled
    dram, disk = manifests["dram"].kv_pool, manifests["dram-disk"].kv_pool
    assert dram.enabled and dram.disk is None and dram.sessions.idle_s == 120.0 and dram.segment_mib == 96
    assert disk.enabled and disk.disk.capacity_gib == 2.0 and disk.sessions is not None


def test_sessions_share_the_system_prompt_and_messages_vary_around_their_mean():
    sessions = make_sessions(_args(), seed=1)
    assert len(sessions) == 3 and len({s["id"] for s in sessions}) == 3
    assert all(s["system"] == sessions[0]["system"] and len(s["system"]) == 256 for s in sessions)
    lengths = [len(m) for s in sessions for m in s["messages"]]
    assert len(lengths) == 12 and all(75 <= n <= 125 for n in lengths)
    assert make_sessions(_args(), seed=1) == sessions and make_sessions(_args(), seed=2) != sessions
