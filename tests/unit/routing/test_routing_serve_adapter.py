"""The Serve adapter's translation of Serve's objects into routing records, the replica's
routing report, and cached-token accounting in OpenAI usage."""

import asyncio
from dataclasses import replace
from types import SimpleNamespace

from deployments.frontend.responses import ResponseContext, full_response, usage_chunk
from deployments.records import EngineRequest, SamplingSpec
from deployments.routing.block_hashes import prompt_block_hashes
from deployments.routing.serve_router import replica_state, routing_request
from tests.unit.ingress_fakes import HELLO, MODEL, FakeEngine, front_end, make_client


def pending(*args):
    return SimpleNamespace(args=list(args), kwargs={})


def test_a_generate_call_is_routed_by_its_prompt_blocks_and_session():
    request = EngineRequest("r1", list(range(40)), SamplingSpec(max_tokens=4), session_id="chat-7")
    routed = routing_request(pending(request), block_size=16, max_blocks=100)
    assert routed.block_hashes == prompt_block_hashes(list(range(40)), 16) and routed.blocks == 2
    assert routed.session_id == "chat-7"
    assert routing_request(pending(request), 16, max_blocks=1).blocks == 1


def test_calls_without_a_prompt_are_not_prefix_routed():
    assert routing_request(None, 16, 10) is None
    assert routing_request(pending(), 16, 10) is None
    assert routing_request(pending({"remote_host": "h"}), 16, 10) is None  # a lease release


def test_a_replica_report_becomes_a_replica_state():
    replica = SimpleNamespace(replica_id=SimpleNamespace(unique_id="abc"),
                              routing_stats={"waiting": 3, "kv_usage": 0.5, "at_s": 12.0, "epoch": "e1",
                                             "prompt_tokens_pending": 5000})
    assert replica_state(replica, 2) == replica_state(replica, 2)
    state = replica_state(replica, 2)
    assert (state.replica_id, state.ongoing, state.queued, state.kv_usage, state.reported_at_s, state.epoch,
            state.prompt_tokens_pending) == ("abc", 2, 3, 0.5, 12.0, "e1", 5000)
    fresh = replica_state(SimpleNamespace(replica_id=SimpleNamespace(unique_id="new"), routing_stats={}), None)
    assert (fresh.ongoing, fresh.queued, fresh.reported_at_s) == (0, 0, None)


def test_usage_reports_cached_prompt_tokens_as_openai_does():
    rendered = asyncio.run(front_end().render(False, {"model": "m", "prompt": [1] * 40}))
    ctx = ResponseContext(rendered, "m")
    choice = [{"index": 0, "text": "x"}]
    assert "prompt_tokens_details" not in full_response(ctx, choice, [[5]])["usage"]
    ctx.note_cached(0, replace(HELLO[0], cached_tokens=32))
    ctx.note_cached(0, replace(HELLO[1], cached_tokens=0))  # only the first delta's count stands
    assert full_response(ctx, choice, [[5]])["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert usage_chunk(ctx, 1)["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


def test_the_ingress_returns_the_engines_cached_token_count():
    engine = FakeEngine(script=[replace(HELLO[0], cached_tokens=16), *HELLO[1:]])
    client, _ = make_client(engine)
    with client:
        body = client.post("/v1/completions", json={"model": MODEL["name"], "prompt": "hi"}).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


def _router(policy: str = "prefix"):
    from deployments.routing.serve_router import PolicyRequestRouter

    router = PolicyRequestRouter.__new__(PolicyRequestRouter)  # Serve's constructor needs a controller
    router.initialize_state(policy=policy, block_size=16, max_blocks=64, pool="decode-test", metrics=False)
    return router


def _replica(rid: str):
    from ray.serve._private.common import DeploymentID, ReplicaID

    return SimpleNamespace(replica_id=ReplicaID(rid, DeploymentID("decode", "app")), routing_stats={})


def test_a_request_decided_before_its_call_goes_to_that_replica_while_it_is_a_candidate(monkeypatch):
    from deployments.routing import serve_router

    router = _router()
    replicas = [_replica("a"), _replica("b"), _replica("c")]
    monkeypatch.setattr(serve_router.PolicyRequestRouter, "replica_queue_len_cache", property(lambda self: {}))
    request = EngineRequest("r1", list(range(40)), SamplingSpec(max_tokens=4), route_to="b")
    ranked = asyncio.run(router.choose_replicas(replicas, pending(request)))
    assert [group[0].replica_id.unique_id for group in ranked][0] == "b"
    assert sorted(g[0].replica_id.unique_id for g in ranked) == ["a", "b", "c"]
    assert router.decisions["decided_before"] == 1
    gone = replace(request, route_to="z")  # replaced since: routed by the policy as usual
    ranked = asyncio.run(router.choose_replicas(replicas, pending(gone)))
    assert router.decisions["decided_before"] == 1 and sum(router.decisions.values()) == 2
    from deployments.routing.router_registry import router_for

    assert router_for("decode-test") is router


def test_decide_routes_with_the_policy_over_the_current_replicas(monkeypatch):
    from deployments.routing import serve_router

    router = _router()
    replicas = {r.replica_id.unique_id: r for r in (_replica("a"), _replica("b"))}
    monkeypatch.setattr(serve_router.PolicyRequestRouter, "replica_queue_len_cache", property(lambda self: {}))
    monkeypatch.setattr(serve_router.PolicyRequestRouter, "curr_replicas", property(lambda self: replicas))
    prompt = list(range(64))
    first = router.decide(prompt, "s")
    again = router.decide(prompt, "s")
    assert first.replica_id in replicas and again.replica_id == first.replica_id
    assert again.expected_hit_blocks == 4  # the router remembers what it sent there: 64 tokens = 4 blocks
    replicas.clear()
    assert router.decide(prompt) is None


def test_the_router_class_pickles_by_value_while_routers_are_live():
    """Ray Serve pickles the router's module by value whenever it serializes the deployment
    config (serve.status() in a driver that holds handles): no live router may be reachable from
    the module's globals (CI: "cannot pickle '_thread.lock' object")."""
    from ray import cloudpickle

    from deployments.routing import serve_router

    live = _router()  # registered, with its lock
    cloudpickle.register_pickle_by_value(serve_router)
    try:
        cloudpickle.loads(cloudpickle.dumps(serve_router.PolicyRequestRouter))
    finally:
        cloudpickle.unregister_pickle_by_value(serve_router)
    assert live.decisions == {}
