"""The engine-cache mirror rebuilt from vLLM's KV events, on hand-made events."""

from deployments.routing.block_hashes import prompt_block_hashes
from deployments.routing.engine_cache_mirror import EngineCacheMirror
from deployments.routing.policies import PrefixAware
from deployments.routing.state import ReplicaState, RoutingRequest

BS = 4
PROMPT = list(range(100, 113))  # 3 full blocks and one token


def test_stored_blocks_get_the_routers_own_hashes():
    mirror = EngineCacheMirror()
    mirror.stored([b"e1", b"e2"], None, PROMPT[:8], BS)
    mirror.stored([b"e3"], b"e2", PROMPT[8:12], BS)  # a later step continues the chain
    assert mirror.snapshot(10) == list(prompt_block_hashes(PROMPT, BS))
    assert mirror.block_size == BS and len(mirror) == 3


def test_removed_and_cleared_blocks_leave_the_mirror():
    mirror = EngineCacheMirror()
    mirror.stored([b"e1", b"e2", b"e3"], None, PROMPT[:12], BS)
    mirror.removed([b"e3", b"unknown"])
    assert mirror.snapshot(10) == list(prompt_block_hashes(PROMPT, BS)[:2])
    mirror.cleared()
    assert mirror.snapshot(10) == []


def test_a_block_whose_parent_was_never_seen_is_not_guessed():
    mirror = EngineCacheMirror()
    mirror.stored([b"e3"], b"e2", PROMPT[8:12], BS)  # joined late: e1 and e2 came before
    assert mirror.snapshot(10) == [] and mirror.orphans == 1


def test_the_snapshot_is_bounded_keeping_the_most_recent():
    mirror = EngineCacheMirror(max_blocks=2)
    mirror.stored([b"e1", b"e2", b"e3"], None, PROMPT[:12], BS)
    assert mirror.snapshot(10) == list(prompt_block_hashes(PROMPT, BS)[1:])
    assert mirror.snapshot(1) == list(prompt_block_hashes(PROMPT, BS)[2:])


def test_the_prefix_policy_routes_by_a_replicas_reported_cache():
    mirror = EngineCacheMirror()
    mirror.stored([b"e1", b"e2", b"e3"], None, PROMPT[:12], BS)
    policy = PrefixAware()
    replicas = [ReplicaState("r0", reported_at_s=10.0),
                ReplicaState("r1", reported_at_s=10.0, resident=tuple(mirror.snapshot(100)))]
    decision = policy.choose(RoutingRequest(prompt_block_hashes(PROMPT, BS)), replicas, 10.0)
    assert (decision.replica_id, decision.expected_hit_blocks, decision.reason) == ("r1", 3, "prefix")
    # The report is the truth: blocks the router itself sent to r0 do not survive r0's report.
    policy.choose(RoutingRequest(prompt_block_hashes([7] * 8, BS)), [replicas[0]], 10.0)
    replicas[0] = ReplicaState("r0", reported_at_s=11.0, resident=())
    assert policy.index.hit_blocks("r0", prompt_block_hashes([7] * 8, BS)) == 2
    policy.choose(RoutingRequest(()), replicas, 11.0)
    assert policy.index.hit_blocks("r0", prompt_block_hashes([7] * 8, BS)) == 0
