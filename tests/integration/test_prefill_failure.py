"""The prefill replica killed mid-prefill (issue 15): no request hangs, none is lost silently,
no lease outlives its prefill, and Serve's replacement serves the same outputs.

Under P/D every request's prompt runs on the prefill pool, which holds the computed blocks under
a lease until decode pulls them. Killing its process while prompts are computing (and others wait
in its queue or are being pulled by decode) must end each request one of two ways, quickly:
  - 200 with its tokens: its KV had reached decode, or decode's pull failed and the failure policy
    (recompute) computed the prompt on decode instead, or it arrived while no prefill replica ran
    and decode computed it from the start (a remote prefill would have waited in Serve's queue
    for the replacement, up to the prefill bound: 125 s in a full local run, then 504);
  - a retriable error: HTTP 503 {"code": "retry"}, or, for a stream, an error event then [DONE].
Runs after the expert-group module (file order); leaves the application as it found it, with a
new prefill replica.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.prompt_set import COMPLETION_PROMPTS, MAX_TOKENS

pytestmark = pytest.mark.integration

# ~1,400 tokens each (well above local_prefill_below_tokens: they go to the prefill pool); the
# leading word makes every prompt's blocks new, so neither prefix cache nor KV pool can serve it.
PROMPT_BODY = "lorem ipsum dolor " * 100
REQUESTS = 16  # half streams: enough queued work that the kill lands mid-prefill
# From the kill to each request's end: Ray reports the actor's death to its callers in seconds;
# decode's pull from the dead prefill fails at transfer_timeout_s (5 s) and recomputes.
END_BOUND_S = 30.0


def _prefill_replicas() -> list:
    from ray.util.state import list_actors

    actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000)
    return [a for a in actors if a.class_name.startswith("ServeReplica:") and a.class_name.endswith(":prefill")]


def _prefill_running(stack) -> bool:
    from ray import serve

    deployment = serve.status().applications[stack.app_name].deployments["prefill"]
    return deployment.status == "HEALTHY" and deployment.replica_states.get("RUNNING", 0) == 1


def _application_running(stack) -> bool:
    from ray import serve

    app = serve.status().applications[stack.app_name]
    return all(d.status == "HEALTHY" for d in app.deployments.values())


def test_a_prefill_killed_mid_prefill_fails_fast_or_recomputes_and_leaks_no_lease(stack, engine_stats,
                                                                                   reference_outputs):
    # Start from a running application: a module before this one may have left a group still
    # restarting (CI: its engines starting on both cores made every prefill here wait).
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not _application_running(stack):
        time.sleep(2)
    assert _application_running(stack), "the application did not come back before this module"
    replicas = _prefill_replicas()
    assert len(replicas) == 1, replicas
    victim = replicas[0]
    killed_at = None

    async def plain(client, i):
        response = await client.post(f"{stack.base_url}/v1/completions", json={
            "model": stack.model, "prompt": f"w{i}x{time.time_ns()} {PROMPT_BODY}", "max_tokens": 16,
            "temperature": 0})
        return "plain", response.status_code, time.monotonic() - killed_at, response.json()

    async def streamed(client, i):
        body = {"model": stack.model, "prompt": f"s{i}x{time.time_ns()} {PROMPT_BODY}", "max_tokens": 16,
                "temperature": 0, "stream": True}
        error, done, texts = None, False, []
        async with client.stream("POST", f"{stack.base_url}/v1/completions", json=body) as response:
            if response.status_code != 200:  # failed before the stream began: a plain JSON error
                return "stream", response.status_code, time.monotonic() - killed_at, json.loads(await response.aread())
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith('data: {"error"'):
                    error = json.loads(line[len("data: "):])
                elif line.startswith("data: "):
                    texts.append(json.loads(line[len("data: "):])["choices"][0]["text"])
        assert done, "a stream must end with [DONE], error or not"
        return "stream", 200 if error is None else "error-event", time.monotonic() - killed_at, error or texts

    async def scenario():
        nonlocal killed_at
        async with httpx.AsyncClient(timeout=httpx.Timeout(180), limits=httpx.Limits(max_connections=32)) as client:
            killed_at = time.monotonic()  # provisional, so that early finishers can be timed
            tasks = [asyncio.ensure_future((plain if i % 2 else streamed)(client, i)) for i in range(REQUESTS)]
            await asyncio.sleep(1.0)  # the first prompts are computing, the rest queue behind them
            killed_at = time.monotonic()
            os.kill(victim.pid, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    outcomes = asyncio.run(scenario())
    failed = [o for o in outcomes if o[1] != 200]
    assert failed, f"the kill landed after every prefill had finished: {outcomes}"
    for kind, status, seconds, body in outcomes:
        assert seconds < END_BOUND_S, (kind, status, seconds, body)  # none hangs
        if status == 200:
            continue
        error = body["error"]
        # Retriable, whether the HTTP status was still to be sent (503) or the stream had begun.
        assert status in (503, "error-event") and error["code"] == "retry", (kind, status, body)
        # The replica's own failure (actor names, addresses) stays in the ingress's log.
        assert "Actor" not in error["message"] and "Error" not in error["message"], error

    # Serve replaces the replica; the new one serves the plain engine's outputs and holds no lease.
    def replaced() -> bool:
        return _prefill_running(stack) and [a.pid for a in _prefill_replicas()] not in ([], [victim.pid])

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not replaced():
        time.sleep(2)
    assert replaced(), (_prefill_replicas(), victim.pid)
    with httpx.Client(timeout=180) as client:
        for name in ("long", "long", "short"):
            response = client.post(f"{stack.base_url}/v1/completions", json={
                "model": stack.model, "prompt": COMPLETION_PROMPTS[name], "max_tokens": MAX_TOKENS,
                "temperature": 0, "return_token_ids": True})
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["token_ids"] == reference_outputs[name]["token_ids"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and engine_stats("prefill").kv_transfer["leases_outstanding"]:
        time.sleep(1)
    assert engine_stats("prefill").kv_transfer["leases_outstanding"] == 0
