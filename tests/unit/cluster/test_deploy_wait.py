"""`deploy` waits for Serve to say RUNNING, reports replica states as they change, and gives
up with Serve's own explanation instead of hanging on a replica that can never be placed."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import ray
from ray import serve

from cluster import serve_control
from cluster.errors import ClusterError


@dataclass
class FakeDeployment:
    status: str
    replica_states: dict
    message: str = ""


@dataclass
class FakeApp:
    status: str
    deployments: dict = field(default_factory=dict)


@dataclass
class FakeStatus:
    applications: dict


def _script(monkeypatch, apps: list[FakeApp]):
    """serve.status() answers with each of `apps` in turn, then keeps answering the last."""
    calls = []

    def status():
        app = apps[min(len(calls), len(apps) - 1)]
        calls.append(app)
        return FakeStatus({"app": app})

    monkeypatch.setattr(serve, "status", status)
    monkeypatch.setattr(ray, "nodes", lambda: [])
    monkeypatch.setattr(serve_control, "_POLL_S", 0.0)
    return calls


def _starting(message: str = "") -> FakeApp:
    return FakeApp("DEPLOYING", {"decode": FakeDeployment("UPDATING", {"STARTING": 2}, message)})


def test_returns_once_running_and_reports_each_change_once(monkeypatch):
    _script(monkeypatch, [_starting(), _starting(), FakeApp("DEPLOYING", {
        "decode": FakeDeployment("UPDATING", {"RUNNING": 1, "STARTING": 1})}), FakeApp("RUNNING")])
    reports = []
    serve_control.wait_until_running("app", timeout_s=60, progress=reports.append)
    assert len(reports) == 2
    assert "decode [starting 2]" in reports[0]
    assert "decode [running 1, starting 1]" in reports[1]


def test_a_replica_that_cannot_be_placed_times_out_with_serves_explanation(monkeypatch):
    why = "Deployment 'decode' has 2 replicas that have taken more than 30s to be scheduled: {'CPU': 8}"
    _script(monkeypatch, [_starting(why)])
    with pytest.raises(ClusterError) as err:
        serve_control.wait_until_running("app", timeout_s=0.05, progress=lambda m: None)
    text = str(err.value)
    assert "did not become RUNNING within 0s" in text
    assert "{'CPU': 8}" in text and "moe-serve down --app app" in text


def test_a_failed_application_fails_at_once(monkeypatch):
    calls = _script(monkeypatch, [FakeApp("DEPLOY_FAILED", {
        "decode": FakeDeployment("DEPLOY_FAILED", {}, "engine start failed: out of memory")})])
    with pytest.raises(ClusterError, match="is DEPLOY_FAILED(.|\n)*out of memory"):
        serve_control.wait_until_running("app", timeout_s=3600, progress=lambda m: None)
    assert len(calls) == 2  # one look to decide, one for the status text
