"""The Mooncake transport on the real stack. Runs near the end (file order): it redeploys the
session's application with `kv_transfer.backend: mooncake`, which restarts both engines."""

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
def mooncake_stack(stack):
    data = yaml.safe_load(stack.manifest_path.read_text())
    data["kv_transfer"]["backend"] = "mooncake"
    deploy_test_app(data, "mooncake manifest", fallback=stack.manifest_path)
    return stack


def test_outputs_identical_and_every_block_pulled_through_mooncake(mooncake_stack, reference_outputs, engine_stats):
    stack = mooncake_stack
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
