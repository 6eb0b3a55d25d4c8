"""Routing policies on hand-made replica states (no Ray, no engines)."""

import pytest

from deployments.routing.block_hashes import prompt_block_hashes
from deployments.routing.policies import LeastLoaded, PrefixAware, RoundRobin, make_policy
from deployments.routing.state import ReplicaState, RoutingRequest

NOW = 1000.0


def replicas(*loads, kv=0.0, reported=NOW, epochs=None):
    return [ReplicaState(f"r{i}", ongoing=load, kv_usage=kv, reported_at_s=reported,
                         epoch=(epochs or {}).get(f"r{i}", "")) for i, load in enumerate(loads)]


def request(tokens, session=None, block_size=4):
    return RoutingRequest(prompt_block_hashes(tokens, block_size), session)


SYSTEM = list(range(64))  # 16 blocks of 4 tokens shared by every conversation


@pytest.mark.parametrize("policy", [RoundRobin(), LeastLoaded(seed=1), PrefixAware()])
def test_an_empty_pool_gives_no_decision(policy):
    assert policy.choose(request(SYSTEM), [], NOW) is None


def test_block_hashes_are_chained_so_a_shared_prefix_shares_exactly_its_blocks():
    a = prompt_block_hashes(SYSTEM + [1, 2, 3, 4], 4)
    b = prompt_block_hashes(SYSTEM + [1, 2, 3, 5], 4)
    assert len(a) == len(b) == 17 and a[:16] == b[:16] and a[16] != b[16]
    assert prompt_block_hashes([9] + SYSTEM[1:], 4)[5] != a[5]  # a change early changes every later hash
    assert prompt_block_hashes(SYSTEM + [1], 4) == a[:16]  # a partial block is not hashed


def test_round_robin_visits_every_replica_in_turn():
    pool = replicas(0, 0, 0)
    policy = RoundRobin()
    assert [policy.choose(request(SYSTEM), pool, NOW).replica_id for _ in range(6)] == ["r0", "r1", "r2"] * 2


def test_least_loaded_takes_the_lighter_of_its_two_samples():
    policy = LeastLoaded(seed=0)
    picks = {policy.choose(request(SYSTEM), replicas(9, 0), NOW).replica_id for _ in range(20)}
    assert picks == {"r1"}


def test_prefix_follows_the_replica_that_computed_the_prefix():
    policy = PrefixAware()
    pool = replicas(0, 0, 0)
    first = policy.choose(request(SYSTEM + [100] * 8), pool, NOW)
    again = [policy.choose(request(SYSTEM + [200 + i] * 8), pool, NOW) for i in range(5)]
    assert {d.replica_id for d in again} == {first.replica_id}
    assert all(d.reason == "prefix" and d.expected_hit_blocks == 16 for d in again)


def test_ties_without_any_cache_hit_spread_over_equally_loaded_replicas():
    policy = PrefixAware()
    pool = replicas(0, 0, 0)
    picks = [policy.choose(request([i] * 64), pool, NOW).replica_id for i in range(6)]
    assert sorted(set(picks)) == ["r0", "r1", "r2"]
    assert all(d == "least_loaded" for d in
               [policy.choose(request([50 + i] * 64), pool, NOW).reason for i in range(3)])


def _holding(policy, tokens):
    """Route `tokens` once on an idle pair; return (holder, other)."""
    holder = policy.choose(request(tokens), replicas(0, 0), NOW).replica_id
    return holder, ("r1" if holder == "r0" else "r0")


def test_the_load_gate_overrides_affinity_when_the_holder_is_far_busier():
    policy = PrefixAware(imbalance_abs=8, imbalance_rel=1.5)
    holder, other = _holding(policy, SYSTEM)
    pool = [ReplicaState(holder, ongoing=20, reported_at_s=NOW), ReplicaState(other, ongoing=2, reported_at_s=NOW)]
    decision = policy.choose(request(SYSTEM), pool, NOW)
    assert (decision.replica_id, decision.reason) == (other, "load_gate")


def test_a_small_load_gap_does_not_break_affinity():
    policy = PrefixAware(imbalance_abs=8, imbalance_rel=1.5)
    holder, other = _holding(policy, SYSTEM)
    pool = [ReplicaState(holder, ongoing=3, reported_at_s=NOW), ReplicaState(other, ongoing=1, reported_at_s=NOW)]
    decision = policy.choose(request(SYSTEM + [5] * 4), pool, NOW)
    assert (decision.replica_id, decision.reason, decision.expected_hit_blocks) == (holder, "prefix", 16)
    assert decision.scores[holder] > decision.scores[other]


def test_when_every_replica_is_saturated_the_least_loaded_still_gets_the_request():
    policy = PrefixAware()
    pool = [ReplicaState("r0", ongoing=64, queued=40, kv_usage=1.0, reported_at_s=NOW),
            ReplicaState("r1", ongoing=64, queued=30, kv_usage=1.0, reported_at_s=NOW)]
    decision = policy.choose(request(SYSTEM), pool, NOW)
    assert decision.replica_id == "r1"


def test_a_stale_report_counts_as_unknown_not_as_idle_or_busy():
    policy = PrefixAware(stale_after_s=10)
    # r0 reported a long queue a minute ago; r1 reports a short one now. Only fresh facts count:
    # r0's old queue is dropped, so r0 (0 in flight from us) and r1 (queue 3) are compared fairly.
    pool = [ReplicaState("r0", queued=50, kv_usage=0.9, reported_at_s=NOW - 60),
            ReplicaState("r1", queued=3, kv_usage=0.1, reported_at_s=NOW)]
    assert policy.choose(request([7] * 64), pool, NOW).replica_id == "r0"
    fresh = [ReplicaState("r0", queued=50, kv_usage=0.9, reported_at_s=NOW),
             ReplicaState("r1", queued=3, kv_usage=0.1, reported_at_s=NOW)]
    assert PrefixAware(stale_after_s=10).choose(request([7] * 64), fresh, NOW).replica_id == "r1"


def test_a_replica_prefilling_one_long_prompt_is_busier_than_one_with_two_short_ones():
    # r0 runs one request whose 32k-token prompt is still prefilling; r1 runs two short ones.
    # Counted in requests r0 looks idler; counted with their tokens (4,096 per request) it is not.
    pool = [ReplicaState("r0", ongoing=1, prompt_tokens_pending=32_768, reported_at_s=NOW),
            ReplicaState("r1", ongoing=2, prompt_tokens_pending=200, reported_at_s=NOW)]
    assert LeastLoaded(seed=0).choose(request(SYSTEM), pool, NOW).replica_id == "r0"
    assert {LeastLoaded(seed=i, prompt_tokens_per_request=4096).choose(request(SYSTEM), pool, NOW).replica_id
            for i in range(10)} == {"r1"}
    assert PrefixAware(prompt_tokens_per_request=4096).choose(request([7] * 64), pool, NOW).replica_id == "r1"
    # A stale report's tokens are as unknown as its queue: only this router's own requests count.
    stale = [ReplicaState("r0", ongoing=1, prompt_tokens_pending=32_768, reported_at_s=NOW - 60),
             ReplicaState("r1", ongoing=2, prompt_tokens_pending=200, reported_at_s=NOW)]
    assert PrefixAware(prompt_tokens_per_request=4096, stale_after_s=10).choose(
        request([7] * 64), stale, NOW).replica_id == "r0"


def test_a_restarted_replica_is_known_to_have_lost_its_cache():
    policy = PrefixAware()
    pool = replicas(0, 0)
    holder = policy.choose(request(SYSTEM), pool, NOW).replica_id
    assert policy.choose(request(SYSTEM), pool, NOW).expected_hit_blocks == 16
    restarted = [ReplicaState(r.replica_id, epoch="e1" if r.replica_id == holder else r.epoch, reported_at_s=NOW)
                 for r in pool]
    decision = policy.choose(request(SYSTEM), restarted, NOW)
    assert decision.expected_hit_blocks == 0 and decision.reason != "prefix"
    assert policy.index.held_blocks(holder) in (0, 16)  # emptied, then refilled only if chosen again


def test_a_replica_that_left_the_pool_is_forgotten():
    policy = PrefixAware()
    policy.choose(request(SYSTEM), replicas(0), NOW)
    assert policy.index.held_blocks("r0") == 16
    policy.choose(request(SYSTEM), [ReplicaState("r9", reported_at_s=NOW)], NOW)
    assert policy.index.held_blocks("r0") == 0


def test_the_index_forgets_the_oldest_blocks_past_the_engine_capacity():
    policy = PrefixAware(capacity_blocks=20)
    pool = replicas(0)
    policy.choose(request(SYSTEM), pool, NOW)
    policy.choose(request([999] * 64), pool, NOW)  # 16 new blocks push 12 of SYSTEM's out
    assert policy.choose(request(SYSTEM), pool, NOW).expected_hit_blocks == 0  # its first block went first


def test_precise_events_override_the_estimate():
    policy = PrefixAware()
    hashes = request(SYSTEM).block_hashes
    policy.index.apply_events("r1", stored=hashes)
    pool = replicas(0, 0)
    assert policy.choose(request(SYSTEM), pool, NOW).replica_id == "r1"
    policy.index.apply_events("r1", removed=hashes[8:])
    assert policy.index.hit_blocks("r1", hashes) == 8
    policy.index.apply_events("r1", cleared=True)
    assert policy.index.hit_blocks("r1", hashes) == 0


def test_a_session_sticks_to_its_replica_until_that_one_is_overloaded():
    policy = PrefixAware(session_slack=4)
    pool = replicas(0, 0, 0)
    pinned = policy.choose(request([1] * 8, session="chat-1"), pool, NOW).replica_id
    for turn in range(3):  # unrelated prompts, same session: same replica
        assert policy.choose(request([50 + turn] * 8, session="chat-1"), pool, NOW).replica_id == pinned
    busy = [ReplicaState(r.replica_id, ongoing=6 if r.replica_id == pinned else 0, reported_at_s=NOW) for r in pool]
    moved = policy.choose(request([90] * 8, session="chat-1"), busy, NOW)
    assert moved.replica_id != pinned


def test_an_unknown_policy_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="least_loaded, prefix, round_robin"):
        make_policy("fastest")
    assert make_policy("prefix", capacity_blocks=8).index.capacity_blocks == 8


def test_with_a_kv_pool_affinity_counts_only_for_what_the_pool_does_not_hold():
    """The same small load gap as above: without a pool the holder keeps the request; with a
    pool that holds the prefix too, any replica can load it, and the lighter one wins."""
    def decide(pool_capacity_blocks):
        policy = PrefixAware(imbalance_abs=8, imbalance_rel=1.5, pool_capacity_blocks=pool_capacity_blocks)
        holder, other = _holding(policy, SYSTEM)
        pool = [ReplicaState(holder, ongoing=3, reported_at_s=NOW), ReplicaState(other, ongoing=1, reported_at_s=NOW)]
        return holder, other, policy.choose(request(SYSTEM + [5] * 4), pool, NOW)

    holder, _, without_pool = decide(0)
    assert (without_pool.replica_id, without_pool.reason) == (holder, "prefix")
    holder, other, with_pool = decide(4096)
    assert (with_pool.replica_id, with_pool.reason, with_pool.expected_hit_blocks) == (other, "pool_prefix", 0)
    # 2 x (0.8 x 16) / 17 - 1/3 against 2 x 16 / 17 - 3/3
    assert with_pool.scores[other] == pytest.approx(2 * 0.8 * 16 / 17 - 1 / 3)
    assert with_pool.scores[holder] == pytest.approx(2 * 16 / 17 - 1)


def test_a_pool_hit_is_worth_less_than_a_local_one_at_equal_load():
    policy = PrefixAware(pool_capacity_blocks=4096, pool_hit_value=0.8)
    holder, other = _holding(policy, SYSTEM)
    decision = policy.choose(request(SYSTEM + [7] * 4), replicas(0, 0), NOW)
    assert (decision.replica_id, decision.reason) == (holder, "prefix")
    assert decision.scores[holder] > decision.scores[other] > 0


def test_the_pool_estimate_forgets_the_oldest_blocks_past_its_capacity():
    policy = PrefixAware(pool_capacity_blocks=16)
    pool = replicas(0, 0)
    policy.choose(request(SYSTEM), pool, NOW)  # 16 blocks: the pool is full
    policy.choose(request(list(range(1000, 1064))), pool, NOW)  # 16 others push them out
    fresh = PrefixAware(pool_capacity_blocks=16)
    # Only the second prompt's blocks are left in the pool's estimate.
    assert policy.pool.held_blocks("<kv pool>") == 16
    assert policy.pool.hit_blocks("<kv pool>", request(SYSTEM).block_hashes) == 0
    assert policy.pool.hit_blocks("<kv pool>", request(list(range(1000, 1064))).block_hashes) == 16
    assert fresh.pool.held_blocks("<kv pool>") == 0


def test_blocks_an_engine_reports_are_in_the_pool_for_every_replica():
    policy = PrefixAware(pool_capacity_blocks=4096)
    hashes = request(SYSTEM).block_hashes
    pool = [ReplicaState("r0", ongoing=2, reported_at_s=NOW, resident=tuple(hashes)),
            ReplicaState("r1", ongoing=0, reported_at_s=NOW, resident=())]
    decision = policy.choose(request(SYSTEM + [9] * 4), pool, NOW)
    # r0 holds 16 of 17 blocks itself, r1 can load them: 2*16/17 - 2/2 < 2*0.8*16/17 - 0
    assert (decision.replica_id, decision.reason) == ("r1", "pool_prefix")
