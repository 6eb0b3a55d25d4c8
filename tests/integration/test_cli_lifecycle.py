"""CLI conventions on the real cluster: Ctrl-C during a deploy stops at once with exit 130; a
node removed from the cluster shows in `moe-serve status` as degraded; `moe-serve down` removes the applications moe-serve deployed (by either path) while a Serve
application someone else deployed keeps running.

Runs last (file order): it removes the session's application.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.conftest import REPO, TEST_GCS_PORT, TEST_HTTP_PORT

pytestmark = pytest.mark.integration

MOE_SERVE = str(Path(sys.executable).parent / "moe-serve")
ENV = {**os.environ, "RAY_AUTH_MODE": "token"}


@pytest.fixture(scope="module")
def foreign_app(stack):
    """A Serve application moe-serve did not deploy (a plain function deployment)."""
    from ray import serve

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    def hello(_request) -> str:
        return "not moe-serve"

    serve.run(hello.bind(), name="foreign", route_prefix="/foreign")
    yield "foreign"
    serve.delete("foreign")


def test_ctrl_c_during_deploy_stops_at_once_with_exit_130(stack, tmp_path):
    # A manifest whose engine needs a node label no node has: the deploy waits for resources,
    # the situation in which users reach for Ctrl-C.
    data = yaml.safe_load((REPO / "manifests" / "local-colocated.yaml").read_text())
    data["name"] = "moe-interrupted"
    data["http"].update(port=TEST_HTTP_PORT, route_prefix="/interrupted")
    manifest_path = tmp_path / "interrupted.yaml"
    manifest_path.write_text(yaml.safe_dump(data))
    # SIGINT as a terminal delivers it: a shell runs background jobs (CI here) with it ignored,
    # which the child would inherit.
    deploy = subprocess.Popen([MOE_SERVE, "deploy", str(manifest_path), "--address", f"127.0.0.1:{TEST_GCS_PORT}"],
                              cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = deploy.stdout.readline()
            seen.append(line)
            if "waiting for 'moe-interrupted'" in line or not line:
                break
        assert any("waiting for 'moe-interrupted'" in line for line in seen), "".join(seen)[-3000:]
        interrupted_at = time.monotonic()
        deploy.send_signal(signal.SIGINT)
        rest, _ = deploy.communicate(timeout=30)
    finally:
        deploy.kill()
    assert deploy.returncode == 130, "".join(seen) + rest
    assert time.monotonic() - interrupted_at < 15
    assert "moe-serve down --app moe-interrupted" in rest, rest


def test_a_node_removed_from_the_cluster_is_reported_as_degraded(stack):
    """A decode node fails: its expert-parallel rank dies with it, Serve cannot place a new group
    (no other node carries the label), and `moe-serve status` says what is degraded and why."""
    from cluster.serve_control import status_text

    stack.cluster.remove_node("decode-1")
    deadline = time.monotonic() + 180
    text = ""
    while time.monotonic() < deadline:
        text = status_text()
        if "left the cluster (moe-role=decode)" in text and f"{stack.app_name}/decode:" in text:
            break
        time.sleep(3)
    result = subprocess.run([MOE_SERVE, "status", "--address", f"127.0.0.1:{TEST_GCS_PORT}"], cwd=REPO, env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    degraded = result.stdout.split("degraded:", 1)[1]
    assert "left the cluster (moe-role=decode)" in degraded, result.stdout
    assert f"{stack.app_name}/decode:" in degraded, result.stdout
    assert f"{stack.app_name}/openai-ingress" not in degraded, result.stdout  # the rest still serves


def test_down_removes_what_moe_serve_deployed_and_leaves_other_apps(stack, foreign_app):
    from ray import serve

    from cluster.kv_pool_service import _actor

    running = set(serve.status().applications)
    assert {stack.app_name, "moe-interrupted", foreign_app} <= running, running
    had_pool = _actor(stack.app_name) is not None
    result = subprocess.run([MOE_SERVE, "down", "--address", f"127.0.0.1:{TEST_GCS_PORT}"], cwd=REPO, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    pool = " and its KV pool" if had_pool else ""
    assert f"deleted application {stack.app_name}{pool}\n" in result.stdout + "\n", result.stdout
    assert "deleted application moe-interrupted" in result.stdout, result.stdout
    assert f"left running (not deployed by moe-serve): {foreign_app}" in result.stdout, result.stdout
    apps = serve.status().applications
    assert stack.app_name not in apps and "moe-interrupted" not in apps, list(apps)
    assert str(getattr(apps[foreign_app].status, "value", apps[foreign_app].status)) == "RUNNING"
    assert httpx.get(f"{stack.base_url}/foreign", timeout=30).text == "not moe-serve"
    assert _actor(stack.app_name) is None  # its KV pool master, if it had one, went with it
