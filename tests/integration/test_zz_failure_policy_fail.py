"""Failure policy "fail": runs last (file order) because it redeploys the session's
application with the decode pool's policy switched, which restarts the engines."""

from __future__ import annotations

import time

import httpx
import pytest
import yaml

from tests.integration.conftest import deploy_test_app
from tests.prompt_set import COMPLETION_PROMPTS, MAX_TOKENS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fail_policy_stack(stack):
    data = yaml.safe_load(stack.manifest_path.read_text())
    data["kv_transfer"]["failure_policy"] = "fail"
    manifest = deploy_test_app(data, "fail-policy manifest", fallback=stack.manifest_path)
    return stack, manifest


def test_injected_failure_with_fail_policy_errors_within_timeout(fail_policy_stack, engine_stats):
    stack, manifest = fail_policy_stack
    started = time.monotonic()
    response = httpx.post(f"{stack.base_url}/v1/completions", headers={"X-Moe-Serve-Inject-KV-Failure": "1"},
                          timeout=60, json={"model": stack.model, "prompt": COMPLETION_PROMPTS["long"],
                                            "max_tokens": MAX_TOKENS, "temperature": 0})
    elapsed_s = time.monotonic() - started
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "retry" and "KV transfer" in error["message"]
    assert elapsed_s < manifest.kv_transfer.transfer_timeout_s + 5
    decode = engine_stats("decode").kv_transfer
    assert decode["pulls_failed_total"] >= 1 and decode["fallbacks_total"] == 0
    # Streaming clients get the same answer before any token: a 503 JSON error.
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", headers={"X-Moe-Serve-Inject-KV-Failure": "1"},
                      timeout=60, json={"model": stack.model, "prompt": "hi", "max_tokens": 4, "stream": True}) as r:
        assert r.status_code == 503
    # Without the fault the same deployment serves normally.
    ok = httpx.post(f"{stack.base_url}/v1/completions", timeout=60,
                    json={"model": stack.model, "prompt": "hi", "max_tokens": 4})
    assert ok.status_code == 200
    deadline = time.monotonic() + 10
    while engine_stats("prefill").kv_transfer["leases_outstanding"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engine_stats("prefill").kv_transfer["leases_outstanding"] == 0
