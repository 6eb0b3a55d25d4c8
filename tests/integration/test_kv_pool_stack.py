"""The cluster-wide KV pool on the real stack: a real Mooncake master (started by `deploy`),
real vLLM engines with our connector's pool tier, real HTTP.

A second application beside the session's default one (which runs without a pool and is the
reference for prompts outside the fixed prompt set): P/D with one prefill and one decode
engine, vLLM's own prefix cache off on both, so every reused block provably came from the
pool. Then the same application colocated with its prefix cache on but a KV cache far smaller
than the working set (capacity beyond one engine's memory), and the pool's master failing.
"""

from __future__ import annotations

import math
import sys
import time

import httpx
import pytest
import yaml

from tests.integration.conftest import DEFAULT_MANIFEST, TEST_HTTP_PORT, deploy_test_app, remove_test_app, settled
from tests.prompt_set import CHAT_CONVERSATIONS, COMPLETION_PROMPTS, MAX_TOKENS

pytestmark = pytest.mark.integration
pytest.importorskip("mooncake.store")

APP = "pool-test"
BLOCK = 128  # vLLM's CPU default block size
ENGINE_BLOCKS = 24  # the colocated engine's whole KV cache (vLLM needs >= max_model_len / BLOCK)
WORKING_SET_PROMPTS = 10
LOCAL_HIT_FRACTION = 0.8


def _log(message: str) -> None:
    print(f"[kv pool] {message}", file=sys.stderr, flush=True)


def _manifest(colocated: bool, decode_first: bool = False) -> dict:
    data = yaml.safe_load(DEFAULT_MANIFEST.read_text())
    data["name"] = APP
    data["http"]["port"] = TEST_HTTP_PORT
    data["http"]["route_prefix"] = f"/{APP}"
    data["kv_pool"] = {"enabled": True, "segment_mib": 64, "local_buffer_mib": 16}
    prefill, decode = data["pools"]
    decode.pop("expert_parallel")  # one decode engine: the session's app holds the other cores
    for pool in (prefill, decode):
        pool["engine"]["enable_prefix_caching"] = False  # every reused block comes from the pool
    if decode_first:
        # Decode chosen first, by what its prefix cache holds (the engine's KV events), and
        # computing the prompt itself when it holds most of it (issue 13's conditional P/D).
        decode["engine"]["enable_prefix_caching"] = True
        decode["routing"] = {"policy": "prefix"}
        data["kv_transfer"]["local_prefill_hit_fraction"] = LOCAL_HIT_FRACTION
    if colocated:
        engine = {**decode["engine"], "enable_prefix_caching": True,
                  "extra_args": {"num_gpu_blocks_override": ENGINE_BLOCKS}}
        data["pools"] = [{**decode, "name": "engine", "role": "colocated", "engine": engine}]
    return data


class PoolApp:
    def __init__(self, stack):
        self.stack = stack
        self.base_url = f"http://127.0.0.1:{TEST_HTTP_PORT}/{APP}"
        self.pools: tuple[str, ...] = ()

    def deploy(self, colocated: bool, decode_first: bool = False) -> None:
        started = time.monotonic()
        deploy_test_app(_manifest(colocated, decode_first), "kv pool test manifest", progress=_log)
        self.pools = ("engine",) if colocated else ("prefill", "decode")
        layout = "colocated" if colocated else "P/D, decode first" if decode_first else "P/D"
        _log(f"{APP} ({layout}) up in {time.monotonic() - started:.0f}s")

    def stats(self, pool: str):
        from ray import serve

        return serve.get_deployment_handle(pool, app_name=APP).stats.remote().result(timeout_s=30)

    def pool_counters(self, pool: str) -> dict:
        from ray import serve

        stats = serve.get_deployment_handle(pool, app_name=APP).stats.remote().result(timeout_s=30)
        return {k: v for k, v in stats.kv_transfer.items() if k.startswith("pool_") or k.startswith("pull")}

    def settled(self, timeout_s: float = 20.0) -> dict[str, dict]:
        """Counters of every pool once no store or pull is in flight (two equal reads)."""
        return settled(lambda: {pool: self.pool_counters(pool) for pool in self.pools}, timeout_s)

    def complete(self, prompt, base_url: str | None = None) -> dict:
        response = httpx.post(f"{base_url or self.base_url}/v1/completions", timeout=180, json={
            "model": self.stack.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        assert response.status_code == 200, response.text
        return {**response.json(), "server_timing": response.headers.get("server-timing", "")}

    def chat(self, messages) -> list[int]:
        response = httpx.post(f"{self.base_url}/v1/chat/completions", timeout=180, json={
            "model": self.stack.model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True})
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def pool_app(stack):
    app = PoolApp(stack)
    app.deploy(colocated=False)
    try:
        yield app
    finally:
        remove_test_app(APP)


def _delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def _full_blocks(tokens: int) -> int:
    return tokens // BLOCK


def test_pd_outputs_with_pool_hits_are_token_identical(pool_app, reference_outputs):
    names = ("short", "question", "long")
    for name in names:  # first round: computed, then stored by prefill and decode
        body = pool_app.complete(COMPLETION_PROMPTS[name])
        assert body["choices"][0]["token_ids"] == reference_outputs[name]["token_ids"], name
    for name, messages in CHAT_CONVERSATIONS.items():
        assert pool_app.chat(messages) == reference_outputs[name]["token_ids"], name
    before = pool_app.settled()
    assert before["prefill"]["pool_blocks_stored_total"] > 0 and before["prefill"]["pool_up"] == 1

    for name in names:  # second round: every full prompt block from the pool, on both sides
        body = pool_app.complete(COMPLETION_PROMPTS[name])
        assert body["choices"][0]["token_ids"] == reference_outputs[name]["token_ids"], name
        if len(reference_outputs[name]["prompt_token_ids"]) >= BLOCK:  # a full block came from the pool
            assert "pool_load;dur=" in body["server_timing"], (name, body["server_timing"])
    for name, messages in CHAT_CONVERSATIONS.items():
        assert pool_app.chat(messages) == reference_outputs[name]["token_ids"], name
    after = pool_app.settled()

    prompts = [len(reference_outputs[n]["prompt_token_ids"]) for n in (*names, *CHAT_CONVERSATIONS)]
    full = sum(_full_blocks(n) for n in prompts)
    assert full >= 9  # the long prompt alone has 9 full blocks
    p, d = after["prefill"], after["decode"]
    bp, bd = before["prefill"], before["decode"]
    # Prefill computed only each prompt's partial last block: the rest was loaded from the pool.
    assert _delta(p, bp, "pool_lookup_hit_blocks_total") == full
    assert _delta(p, bp, "pool_blocks_loaded_total") == full
    # Decode took the same prefix from the pool and only the remainder from prefill's lease.
    assert _delta(d, bd, "pool_blocks_loaded_total") == full
    pulled = _delta(d, bd, "pulls_succeeded_total")
    assert pulled == sum(1 for n in prompts if n % BLOCK)  # prompts with a partial last block
    assert _delta(p, bp, "pool_load_failures_total") == 0 and _delta(d, bd, "pool_load_failures_total") == 0
    # Nothing new to store: the pool already held every block the second round computed fully.
    assert _delta(p, bp, "pool_blocks_stored_total") == 0


def test_the_pool_health_of_every_engine_reaches_prometheus(pool_app, stack):
    """The dashboard's and the alert's query (kv_pool_down) sees both engines, with the pool up.
    (Its series exist only while an application with a pool runs, so the observability module,
    later, cannot check it.)"""
    from monitoring.prometheus_api import PrometheusAPI
    from monitoring.queries import KV_POOL_DOWN

    api = PrometheusAPI(stack.prometheus_url)
    deadline = time.monotonic() + 60
    while True:
        down = {sample.labels.get("pool"): sample.value for sample in api.query(KV_POOL_DOWN.expr)}
        if {"prefill", "decode"} <= set(down) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert down.get("prefill") == 0 and down.get("decode") == 0, down


def test_multi_turn_history_comes_from_the_pool(pool_app, stack):
    """Each turn's prompt is the previous prompt, its answer and a new message (token ids, as a
    chat front end would send them): prefill must find the whole history in the pool, the
    answers included, which only decode computed and stored."""
    prompt = pool_app.complete(COMPLETION_PROMPTS["long"])["prompt_token_ids"]
    follow_up = pool_app.complete(" And then, what happened next in the story of the old lighthouse keeper?")
    new_message = follow_up["prompt_token_ids"]
    history_blocks, hit_blocks = 0, 0
    for turn in range(3):
        before = pool_app.settled()
        ours = pool_app.complete(prompt)
        plain = pool_app.complete(prompt, base_url=stack.base_url)  # the session's app: no pool
        assert ours["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"], f"turn {turn + 1}"
        after = pool_app.settled()
        if turn:
            hit_blocks += _delta(after["prefill"], before["prefill"], "pool_lookup_hit_blocks_total")
        answer = ours["choices"][0]["token_ids"]
        # What decode computed and stored: prompt and answer but its last token (never fed back).
        history_blocks += _full_blocks(len(prompt) + len(answer) - 1) if turn < 2 else 0
        prompt = prompt + answer + new_message
        assert len(prompt) + MAX_TOKENS < stack.max_model_len
    _log(f"turns 2-3: {hit_blocks} of {history_blocks} history blocks from the pool")
    assert history_blocks > 0 and hit_blocks >= math.ceil(0.9 * history_blocks)

def test_the_pd_path_with_the_pool_answers_every_openai_feature_as_vllms_server_does(pool_app, vllm_feature_answers):
    """P/D without expert parallelism (one prefill, one decode engine, the KV pool on): the
    answers the P/D + EP and colocated paths are held to (openai_features.py)."""
    from tests.integration.openai_features import FEATURES, ask, assert_same_answer

    for feature in FEATURES:
        assert_same_answer(feature, ask(pool_app.base_url, pool_app.stack.model, feature), vllm_feature_answers[feature])


def test_decode_first_computes_a_turn_whose_history_it_holds_without_the_prefill(pool_app, stack):
    """Decode chosen first (prefix-aware, from its engine's KV events): turn 1 of a conversation
    is prefilled remotely as usual; turn 2's history (turn 1's prompt and answer) is in the
    chosen decode replica's prefix cache, more than LOCAL_HIT_FRACTION of the prompt, so decode
    computes the rest itself and the prefill pool never sees the request. Output: the plain
    engine's, both turns."""
    pool_app.deploy(colocated=False, decode_first=True)
    plain_first = pool_app.complete(COMPLETION_PROMPTS["long"], base_url=stack.base_url)
    prompt = plain_first["prompt_token_ids"]
    new_message = pool_app.complete(" And what did the keeper write in his log that night?",
                                    base_url=stack.base_url)["prompt_token_ids"]

    before = {pool: pool_app.stats(pool) for pool in ("prefill", "decode")}
    first = pool_app.complete(prompt)
    assert first["choices"][0]["token_ids"] == plain_first["choices"][0]["token_ids"]
    middle = {pool: pool_app.stats(pool) for pool in ("prefill", "decode")}
    assert middle["prefill"].started_total - before["prefill"].started_total == 1  # nothing cached yet: remote

    second_prompt = prompt + first["choices"][0]["token_ids"] + new_message
    held = _full_blocks(len(prompt) + len(first["choices"][0]["token_ids"]) - 1) * BLOCK
    assert held >= LOCAL_HIT_FRACTION * len(second_prompt)  # the trace is one the rule applies to
    time.sleep(3.0)  # KV events reach the replica in ms; Serve asks it for its routing report each second
    second = pool_app.complete(second_prompt)
    plain_second = pool_app.complete(second_prompt, base_url=stack.base_url)
    assert second["choices"][0]["token_ids"] == plain_second["choices"][0]["token_ids"]
    after = {pool: pool_app.stats(pool) for pool in ("prefill", "decode")}
    assert after["prefill"].started_total == middle["prefill"].started_total, "turn 2 went to the prefill pool"
    assert after["decode"].started_total - middle["decode"].started_total == 1
    pulls = "pulls_succeeded_total"
    assert after["decode"].kv_transfer.get(pulls, 0) == middle["decode"].kv_transfer.get(pulls, 0)


# -- hostile input: client-set transfer parameters never reach the KV connector -----------------


class _ConnectionCounter:
    """A listening socket that counts who connects: where forged parameters point a pull."""

    def __enter__(self):
        import socket
        import threading

        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()
        return self

    def _accept(self):
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._listener.close()


def _forged_pull(port: int) -> dict:
    return {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
            "remote_engine_id": "attacker", "remote_request_id": "x", "remote_block_ids": [0, 1, 2, 3],
            "remote_num_tokens": 4 * BLOCK, "block_size_tokens": BLOCK, "lease_deadline_unix_s": 4e9}


def _hostile_bodies(port: int) -> list[tuple[str, str]]:
    """(the field a 400 must name, the raw JSON of the extra fields): raw, so NaN survives."""
    import json

    return [("kv_transfer_params", '"kv_transfer_params": {"do_remote_prefill": true, "remote_num_tokens": "x"}'),
            ("kv_transfer_params", '"kv_transfer_params": {"do_remote_decode": true, "lease_s": 3600}'),
            ("kv_transfer_params", '"kv_transfer_params": {"do_remote_decode": true, "lease_s": NaN}'),
            ("kv_transfer_params", f'"kv_transfer_params": {json.dumps(_forged_pull(port))}'),
            ("vllm_xargs", '"vllm_xargs": {"kv_transfer_params": "x"}')]


def _leases_outstanding(pool_app) -> dict[str, int]:
    return {pool: pool_app.stats(pool).kv_transfer.get("leases_outstanding", 0) for pool in pool_app.pools}


def _hostile_input_is_refused_and_harmless(pool_app, stack) -> None:
    """The reported attacks on this layout: each body is a 400 naming the field; the same
    parameters sent below the ingress, straight to every engine, are ignored (the engine server
    owns the engine's extra_args); no engine dies, pins a lease or connects where they point."""
    import json

    from ray import serve
    from vllm import SamplingParams

    from deployments.records import EngineFailure, EngineRequest, TokenDelta

    prompt = COMPLETION_PROMPTS["long"]
    with _ConnectionCounter() as attacker:
        for field, extra in _hostile_bodies(attacker.port):
            for route, base in (("completions", f'"prompt": {json.dumps(prompt)}'),
                                ("chat/completions", '"messages": [{"role": "user", "content": "hi"}]')):
                body = f'{{"model": {json.dumps(stack.model)}, {base}, "max_tokens": 4, {extra}}}'
                response = httpx.post(f"{pool_app.base_url}/v1/{route}", content=body, timeout=60,
                                      headers={"content-type": "application/json"})
                assert response.status_code == 400, (route, extra, response.text)
                assert response.json()["error"]["param"] == field
        token_ids = pool_app.complete(prompt)["prompt_token_ids"]
        for i, pool in enumerate(pool_app.pools):
            sampling = SamplingParams(max_tokens=4, temperature=0, extra_args={"kv_transfer_params": {
                **_forged_pull(attacker.port), "do_remote_decode": True, "lease_s": 3600}})
            handle = serve.get_deployment_handle(pool, app_name=APP).options(stream=True)
            items = list(handle.generate.remote(EngineRequest(f"hostile-{i}", token_ids, sampling)))
            assert not any(isinstance(item, EngineFailure) for item in items), items
            assert isinstance(items[-1], TokenDelta) and items[-1].finish_reason == "length", items[-1]
        pool_app.complete(prompt)  # every engine still serves
        assert attacker.accepted == 0, "a forged pull made an engine connect"
    deadline = time.monotonic() + 15  # a real prefill's lease is released once decode pulled it
    while any(_leases_outstanding(pool_app).values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_leases_outstanding(pool_app).values()), _leases_outstanding(pool_app)


def test_hostile_transfer_params_on_decode_first_pd_are_refused_and_harmless(pool_app, stack):
    """Decode chosen first, which prefills short and held prompts itself: the exposed layout."""
    _hostile_input_is_refused_and_harmless(pool_app, stack)


def _working_set() -> list[str]:
    """Distinct prompts of ten full blocks each: the chapter number in the first block makes
    every block's chained hash differ from the other prompts'."""
    return [f"Chapter {i} of the keeper's log. " + "lorem ipsum dolor " * 95 for i in range(WORKING_SET_PROMPTS)]


def test_a_working_set_four_times_the_engines_kv_cache_still_hits_the_pool(pool_app, stack):
    """Colocated, vLLM's prefix cache on but the engine's whole KV cache only ENGINE_BLOCKS
    blocks: cycling through prompts worth more than 4x that, every revisit finds its prefix
    evicted from the engine and loads it from the pool, with the plain engine's output."""
    pool_app.deploy(colocated=True)
    prompts = _working_set()
    first = [pool_app.complete(prompt) for prompt in prompts]
    tokens = [body["usage"]["prompt_tokens"] for body in first]
    full = sum(_full_blocks(n) for n in tokens)
    assert sum(tokens) >= 4 * ENGINE_BLOCKS * BLOCK, tokens
    plain = [pool_app.complete(prompt, base_url=stack.base_url) for prompt in prompts]
    before = pool_app.settled()["engine"]
    again = [pool_app.complete(prompt) for prompt in prompts]
    after = pool_app.settled()["engine"]
    for i, (ours, theirs, revisit) in enumerate(zip(first, plain, again)):
        assert ours["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"], f"prompt {i}, first visit"
        assert revisit["choices"][0]["token_ids"] == theirs["choices"][0]["token_ids"], f"prompt {i}, from the pool"
    loaded = _delta(after, before, "pool_blocks_loaded_total")
    _log(f"working set {sum(tokens)} tokens vs engine KV {ENGINE_BLOCKS * BLOCK}: {loaded} of {full} "
         f"revisited blocks from the pool")
    assert loaded >= math.ceil(0.9 * full)
    pool_app.outputs = {prompt: body["choices"][0]["token_ids"] for prompt, body in zip(prompts, plain)}


def test_hostile_transfer_params_on_a_colocated_pool_with_the_kv_pool_are_refused_and_harmless(pool_app, stack):
    """The layout of the report: one request used to kill this engine (503 EngineDeadError)."""
    _hostile_input_is_refused_and_harmless(pool_app, stack)


def test_cache_salt_keeps_tenants_cached_blocks_apart(pool_app, stack):
    """vLLM's cache_salt, through our ingress: a prompt another tenant sent is not reported (or
    served) as cached to a request with another salt, neither from the engine's prefix cache
    nor from the KV pool; with the same salt it is. Outputs do not change."""
    prompt = "Salted prompt of the keeper's log. " + "lorem ipsum dolor " * 40

    def send(salt: str) -> dict:
        response = httpx.post(f"{pool_app.base_url}/v1/completions", timeout=180, json={
            "model": stack.model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "cache_salt": salt,
            "return_token_ids": True})
        assert response.status_code == 200, response.text
        return response.json()

    first = send("tenant-a")
    again = send("tenant-a")
    other = send("tenant-b")
    cached = [body["usage"].get("prompt_tokens_details", {}) or {} for body in (first, again, other)]
    assert cached[1].get("cached_tokens", 0) >= BLOCK, cached  # the same tenant hits its own blocks
    assert cached[2].get("cached_tokens", 0) == 0, cached  # another tenant learns nothing
    assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"] == other["choices"][0]["token_ids"]


def test_corrupted_objects_are_never_used_and_the_engine_recomputes(pool_app):
    """Every object of the application in the real pool gets one byte flipped (through a
    Mooncake client of the test's own, keys listed by the master): revisits fail
    verification, the engine recomputes with the same output, and drops the bad objects so
    that its stores replace them and later revisits load from the pool again."""
    from mooncake.store import MooncakeDistributedStore

    from cluster.kv_pool_service import ensure_pool

    if not getattr(pool_app, "outputs", None):
        pytest.skip("needs the working set of the test before")
    pool = ensure_pool(APP)
    host = pool["master_address"].rsplit(":", 1)[0]
    keys = [k for k in httpx.get(f"http://{host}:{pool['metrics_port']}/get_all_keys", timeout=10).text.split()
            if k.startswith(f"{APP}/")]
    assert keys, "the working set left no objects in the pool"
    client = MooncakeDistributedStore()
    assert client.setup(host, pool["metadata_url"], 64 << 20, 16 << 20, "tcp", "", pool["master_address"]) == 0
    try:
        for key in keys:
            damaged = bytearray(client.get(key))
            damaged[-1] ^= 0xFF  # the payload's last byte: only the checksum can tell
            assert client.upsert(key, bytes(damaged)) == 0, key
        prompts = list(pool_app.outputs)[:3]
        before = pool_app.settled()["engine"]
        for prompt in prompts:
            assert pool_app.complete(prompt)["choices"][0]["token_ids"] == pool_app.outputs[prompt], "corrupt pool"
        after = pool_app.settled()["engine"]
        assert _delta(after, before, "pool_corrupt_objects_total") >= len(prompts)
        assert _delta(after, before, "pool_blocks_loaded_total") == 0
        # The bad objects were removed and stored afresh: the next revisits load again.
        for prompt in list(pool_app.outputs)[3:] + prompts:
            assert pool_app.complete(prompt)["choices"][0]["token_ids"] == pool_app.outputs[prompt]
        healed = pool_app.settled()["engine"]
        assert _delta(healed, after, "pool_blocks_loaded_total") >= _full_blocks(1200) * len(prompts)
    finally:
        client.close()


def test_the_colocated_engine_survives_the_master_dying_and_reuses_the_pool_again(pool_app):
    """With the master killed every request still succeeds with the same output (the engine
    recomputes; the fallback is counted), and after the supervisor restarts it hits resume.
    (Objects live in the engines' segments: a restarted master starts empty.)"""
    from cluster.kv_pool_service import kill_master

    if not getattr(pool_app, "outputs", None):
        pytest.skip("needs the working set of the test before")
    prompts = list(pool_app.outputs)
    before = pool_app.settled()["engine"]
    kill_master(APP)
    for prompt in prompts[:3]:
        assert pool_app.complete(prompt)["choices"][0]["token_ids"] == pool_app.outputs[prompt], "master down"
    down = pool_app.settled()["engine"]
    assert down["pool_lookup_failures_total"] + down["pool_load_failures_total"] > \
        before["pool_lookup_failures_total"] + before["pool_load_failures_total"]

    # The engine retries after retry_after_s and stores again; a prompt revisited after the
    # others evicted it from the engine loads from the pool again.
    deadline = time.monotonic() + 120
    for round_ in range(100):
        prompt = prompts[round_ % len(prompts)]
        assert pool_app.complete(prompt)["choices"][0]["token_ids"] == pool_app.outputs[prompt]
        now = pool_app.settled()["engine"]
        if _delta(now, down, "pool_blocks_loaded_total") >= 10:
            break
        assert time.monotonic() < deadline, f"no pool hits after the master restarted: {now}"
    assert now["pool_up"] == 1
