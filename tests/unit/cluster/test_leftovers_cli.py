"""`moe-serve up` checks for leftovers before it starts anything: a held port refuses the start
with one line and exit 3, never a traceback; a port taken during the start (HAProxy's bind
failure) is reported the same way. The cluster, Serve and the process scan are stand-ins here;
the scan on real processes is in test_leftovers_processes.py."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

import cluster.checkpoints
import cluster.leftover_processes
import cluster.local_cluster
import cluster.serve_control
from cluster import cli
from cluster.errors import ClusterError

REPO = Path(__file__).resolve().parents[3]
MANIFEST = str(REPO / "manifests" / "local-deepseek.yaml")
HELD = ("port 8000 (the HTTP endpoint, http.port) is in use by pid 6001 (`python3 -m http.server 8000`), which "
        "moe-serve did not start. Stop it (`kill 6001`), or set http.port in the manifest to a free port")


class FakeCluster:
    made: list["FakeCluster"] = []
    address = "127.0.0.1:6379"
    dashboard_url = "http://127.0.0.1:8265"

    def __init__(self):
        self.started = self.stopped = False

    @classmethod
    def for_manifest(cls, manifest, ports):
        cluster = cls()
        cls.made.append(cluster)
        return cluster

    def start(self, progress=print):
        self.started = True
        return self

    def shutdown(self):
        self.stopped = True


@pytest.fixture
def up(monkeypatch):
    """Everything `up` touches but the leftover check, as stand-ins; the SIGTERM handler `up`
    installs is put back."""
    FakeCluster.made = []
    monkeypatch.setattr(cli, "check_fit", lambda manifest: None)
    monkeypatch.setattr(cluster.checkpoints, "resolve_model_path", lambda path, **kw: path)
    monkeypatch.setattr(cluster.local_cluster, "LocalCluster", FakeCluster)
    monkeypatch.setattr(cluster.serve_control, "connect", lambda address: None)
    handler = signal.getsignal(signal.SIGTERM)
    yield monkeypatch
    signal.signal(signal.SIGTERM, handler)


def test_a_held_port_refuses_up_before_anything_starts_with_one_line(up, capsys):
    seen = {}

    def held(needs, progress):
        seen["ports"] = [need.port for need in needs]
        raise ClusterError(HELD)

    up.setattr(cluster.leftover_processes, "clear_leftovers", held)
    assert cli.main(["up", MANIFEST, "--gcs-port", "6400", "--no-prometheus"]) == 3
    assert seen["ports"] == [8000, 6400, 8265]
    assert FakeCluster.made == []  # refused at once: no cluster, no checkpoint build
    err = capsys.readouterr().err
    assert err == f"error: {HELD}\n"


def test_a_port_taken_during_the_start_is_named_not_a_traceback(up, capsys):
    up.setattr(cluster.leftover_processes, "clear_leftovers", lambda needs, progress: [])
    up.setattr(cluster.leftover_processes, "port_holders", lambda needs: [HELD])

    def deploy(manifest, progress, timeout_s):
        raise RuntimeError("HAProxy crashed during startup: [NOTICE] (1) : haproxy version is 2.8.25\n"
                           "[ALERT] (1) : Binding [haproxy.cfg:30] for frontend http_frontend: "
                           "cannot bind socket (Address already in use) [127.0.0.1:8000]\n"
                           "[ALERT] (1) : Fatal errors found in configuration.\n")

    up.setattr(cluster.serve_control, "deploy", deploy)
    assert cli.main(["up", MANIFEST, "--no-prometheus"]) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert ("error: a port was taken while the cluster started: [ALERT] (1) : Binding [haproxy.cfg:30] for "
            "frontend http_frontend: cannot bind socket (Address already in use) [127.0.0.1:8000]\n" + HELD) in err
    [made] = FakeCluster.made
    assert made.started and made.stopped  # what was started is stopped


def test_other_start_failures_are_not_taken_for_a_held_port(up):
    up.setattr(cluster.leftover_processes, "clear_leftovers", lambda needs, progress: [])

    def deploy(manifest, progress, timeout_s):
        raise RuntimeError("something else")

    up.setattr(cluster.serve_control, "deploy", deploy)
    with pytest.raises(RuntimeError, match="something else"):
        cli.main(["up", MANIFEST, "--no-prometheus"])
