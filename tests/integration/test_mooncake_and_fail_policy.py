"""The Mooncake transport and failure policy "fail" on the real stack. Runs near the end (file
order): it redeploys the session's application with `kv_transfer.backend: mooncake` and
`failure_policy: fail` (one redeploy for both: each restarts the engines, ~1 min), and the
modules after it keep that application. The fault-injection hook fails a pull before any
transport is asked, so the policy is proven whatever the backend."""

from __future__ import annotations

import math
import time

import httpx
import pytest
import yaml

from tests.integration.conftest import deploy_test_app
from tests.prompt_set import COMPLETION_PROMPTS, MAX_TOKENS

pytestmark = pytest.mark.integration
pytest.importorskip("mooncake.engine")

CPU_BLOCK_SIZE_TOKENS = 128


@pytest.fixture(scope="module")
def mooncake_fail_stack(stack):
    data = yaml.safe_load(stack.manifest_path.read_text())
    data["kv_transfer"].update(backend="mooncake", failure_policy="fail")
    manifest = deploy_test_app(data, "mooncake + fail-policy manifest", fallback=stack.manifest_path)
    return stack, manifest


def test_outputs_identical_and_every_block_pulled_through_mooncake(mooncake_fail_stack, reference_outputs,
                                                                   engine_stats):
    stack, _ = mooncake_fail_stack
    expected_blocks = 0
    for name in ("short", "long"):
        response = httpx.post(f"{stack.base_url}/v1/completions", timeout=120, json={
            "model": stack.model, "prompt": COMPLETION_PROMPTS[name], "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["token_ids"] == reference_outputs[name]["token_ids"]
        expected_blocks += math.ceil(body["usage"]["prompt_tokens"] / CPU_BLOCK_SIZE_TOKENS)
    deadline = time.monotonic() + 10
    while engine_stats("prefill").kv_transfer["leases_outstanding"] and time.monotonic() < deadline:
        time.sleep(0.2)
    decode, prefill = engine_stats("decode").kv_transfer, engine_stats("prefill").kv_transfer
    assert decode["pulls_succeeded_total"] == 2 and decode["pulls_failed_total"] == 0
    assert decode["blocks_loaded_total"] == expected_blocks
    assert prefill["leases_outstanding"] == 0 and prefill["leases_released_total"] == 2


def test_injected_failure_with_fail_policy_errors_within_timeout(mooncake_fail_stack, engine_stats):
    stack, manifest = mooncake_fail_stack
    started = time.monotonic()
    response = httpx.post(f"{stack.base_url}/v1/completions", headers={"X-Moe-Serve-Inject-KV-Failure": "1"},
                          timeout=60, json={"model": stack.model, "prompt": COMPLETION_PROMPTS["long"],
                                            "max_tokens": MAX_TOKENS, "temperature": 0})
    elapsed_s = time.monotonic() - started
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    # Retriable, and naming nothing internal (the engine's own reason is in the ingress's log).
    assert error["code"] == "retry" and error["type"] == "service_unavailable"
    assert "KV" not in error["message"] and "Error" not in error["message"]
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
