"""The KV pool's master service: supervision without Ray, then the detached actor on a local Ray."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytest.importorskip("mooncake.store")

from cluster.kv_pool_service import KVPoolMaster, ensure_pool, kill_master, port_open, stop_pool  # noqa: E402


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


def test_supervisor_restarts_a_killed_master_on_the_same_ports(tmp_path):
    service = KVPoolMaster("unit", log_dir=str(tmp_path))
    try:
        wait_for(service.ready, 15, "master never accepted connections")
        first = service.address()
        assert first["master_address"] == f"127.0.0.1:{service.config.rpc_port}"
        assert first["metadata_url"] == f"http://127.0.0.1:{service.config.http_port}/metadata"
        assert service.kill_master() == first["pid"]
        wait_for(lambda: service.address()["restarts"] == 1 and service.ready(), 15, "master not restarted")
        second = service.address()
        assert second["pid"] != first["pid"]
        assert second["master_address"] == first["master_address"]
        assert second["metadata_url"] == first["metadata_url"]
        assert "master_service" in open(first["log_path"]).read()  # its glog lines reach our log file
    finally:
        service.stop()
    assert not alive(second["pid"]) and not port_open("127.0.0.1", service.config.rpc_port)
    assert service.address()["restarts"] == 1  # a stop is not a crash


def test_ensure_pool_runs_one_detached_actor_per_app():
    ray = pytest.importorskip("ray")
    # "local": a fresh cluster of this test's own, never one that is already running here;
    # in the full suite the integration session's driver is still connected: use its cluster.
    own_cluster = not ray.is_initialized()
    if own_cluster:
        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
                 object_store_memory=80 << 20, logging_level="ERROR")
    first = None
    try:
        first = ensure_pool("unit-app")
        assert port_open("127.0.0.1", int(first["master_address"].rsplit(":", 1)[1]))
        again = ensure_pool("unit-app")
        assert again["pid"] == first["pid"] and again["master_address"] == first["master_address"]
        actor = ray.get_actor("moe-serve-kv-pool-unit-app", namespace="moe-serve")
        assert kill_master("unit-app") == first["pid"]
        wait_for(lambda: ray.get(actor.address.remote())["restarts"] == 1 and ray.get(actor.ready.remote()), 15,
                 "the actor's supervisor did not restart the master")
        restarted_pid = ray.get(actor.address.remote())["pid"]
        assert stop_pool("unit-app") is True
        assert not alive(restarted_pid)

        def gone() -> bool:
            try:
                ray.get_actor("moe-serve-kv-pool-unit-app", namespace="moe-serve")
                return False
            except ValueError:
                return True

        wait_for(gone, 10, "the actor outlived stop_pool")
        assert stop_pool("unit-app") is False and kill_master("unit-app") is None
    finally:
        stop_pool("unit-app")
        if own_cluster:
            ray.shutdown()
        if first is not None:
            Path(first["log_path"]).unlink(missing_ok=True)
