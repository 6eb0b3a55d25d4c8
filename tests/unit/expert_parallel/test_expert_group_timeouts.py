"""An expert-parallel group with a rank that is alive but hung: the group's relay bounds its own
waits (request_timeouts), so the request fails within the bound and is aborted on its rank even
if the caller's cancellation never arrives, while the group's other rank keeps serving.
(rank_failure_timeout_s covers only dead ranks and the wait for a cancelled rank to let go.)"""

from __future__ import annotations

import asyncio
import time

import deployments.expert_parallel.expert_group as expert_group
from deployments.expert_parallel.expert_group import ExpertParallelGroup
from deployments.records import PrefillResult, TokenDelta, WaitExpired
from tests.unit.ingress_fakes import FakeMetricsBackend
from tests.unit.expert_parallel.test_expert_group import ENGINE, FakeRankActor, FakeServer, _Method, drain, request

TIMEOUTS = {"prefill_timeout_s": 0.3, "first_token_timeout_s": 0.6, "inter_token_timeout_s": 0.3}
SLACK_S = 2.0
GUARD_S = 15.0


class HangingServer(FakeServer):
    """FakeServer that can hang before its first token, and serves prefills behind a gate."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hang_first = False
        self.prefill_gate = asyncio.Event()
        self.released: list[dict] = []

    async def generate(self, request):
        if self.hang_first:
            self.requests.append(request.request_id)
            try:
                await asyncio.Event().wait()
            except (GeneratorExit, asyncio.CancelledError):
                self.aborted.append(request.request_id)
                raise
        async for item in super().generate(request):
            yield item

    async def prefill(self, request):
        await self.prefill_gate.wait()
        return PrefillResult({"remote_request_id": request.request_id}, 3, 0.01)

    async def release(self, params):
        self.released.append(params)


def make_group():
    remotes, locals_ = [], []

    def remote_factory(rank, model, engine, model_path, kv_transfer, **kwargs):
        actor = FakeRankActor(HangingServer(model, engine, model_path, kv_transfer, rank=rank, **kwargs))
        remotes.append(actor)
        return actor

    def local_factory(*args, **kwargs):
        locals_.append(HangingServer(*args, **kwargs))
        return locals_[-1]

    group = ExpertParallelGroup({"name": "m"}, ENGINE, "/ckpt", None, {"size": 2, "rank_failure_timeout_s": 0.2},
                                {}, "cpu", pool_name="decode", remote_rank_factory=remote_factory,
                                local_server_factory=local_factory, metrics_backend=FakeMetricsBackend(),
                                cancel_remote=lambda refs: None, request_timeouts=TIMEOUTS)
    return group, locals_[0], remotes[0].server


async def timed(coro):
    started = time.monotonic()
    return await coro, time.monotonic() - started


def test_a_rank_hung_between_tokens_fails_its_request_in_time_and_the_other_rank_serves():
    async def scenario():
        group, local, remote = make_group()
        remote.gate.clear()  # rank 1 sends its first token, then hangs (alive: no watchdog event)
        hung = asyncio.ensure_future(timed(drain(group.generate(request(0)))))  # rank 0
        await asyncio.sleep(0)
        stuck = asyncio.ensure_future(timed(drain(group.generate(request(1)))))  # rank 1
        (served, _), (failed, failed_s) = await asyncio.gather(hung, stuck)
        return group, remote, served, failed, failed_s

    group, remote, served, failed, failed_s = asyncio.run(asyncio.wait_for(scenario(), GUARD_S))
    assert [d.text for d in served] == ["a", "b"]
    assert failed[0].text == "a" and isinstance(failed[1], WaitExpired) and failed[1].wait == "inter_token"
    assert failed_s < TIMEOUTS["inter_token_timeout_s"] + SLACK_S
    assert remote.aborted == ["req-1"]  # cancelled on its rank: the rank aborts it in its engine
    assert group._in_flight == [0, 0]
    assert not group._broken  # a slow or hung request is not a dead rank


def test_a_rank_hung_before_its_first_token_fails_within_the_first_token_bound():
    async def scenario():
        group, local, _ = make_group()
        local.hang_first = True
        return await timed(drain(group.generate(request(0))))

    (items, elapsed_s) = asyncio.run(asyncio.wait_for(scenario(), GUARD_S))
    assert len(items) == 1 and isinstance(items[0], WaitExpired) and items[0].wait == "first_token"
    assert TIMEOUTS["first_token_timeout_s"] * 0.9 <= elapsed_s < TIMEOUTS["first_token_timeout_s"] + SLACK_S


def test_a_rank_hung_in_prefill_fails_in_time_and_a_late_lease_is_released(monkeypatch):
    monkeypatch.setattr(expert_group, "ABORT_GRACE_S", 0.05)  # the rank's own abort grace (5 s in production)

    async def scenario():
        group, local, _ = make_group()
        result, elapsed_s = await timed(group.prefill(request(0)))  # rank 0's prefill hangs
        assert group._in_flight == [1, 0]  # still held by the hung rank: routing avoids it
        local.prefill_gate.set()  # the rank finishes after all, with a lease nobody waits for
        for _ in range(100):
            if local.released:
                break
            await asyncio.sleep(0.01)
        return group, local, result, elapsed_s

    group, local, result, elapsed_s = asyncio.run(asyncio.wait_for(scenario(), GUARD_S))
    assert isinstance(result, WaitExpired) and result.wait == "prefill"
    assert elapsed_s < TIMEOUTS["prefill_timeout_s"] + 0.1 + 0.2 + SLACK_S
    assert local.released == [{"remote_request_id": "req-0"}]
    assert group._in_flight == [0, 0]


def test_items_within_the_bounds_pass_through_unchanged():
    async def scenario():
        group, _, _ = make_group()
        return await drain(group.generate(request(0)))

    assert asyncio.run(asyncio.wait_for(scenario(), GUARD_S)) == [TokenDelta("a", [1], None, 3, 1),
                                                                   TokenDelta("b", [2], "length", 3, 2)]


# --- the hung-group watchdog (check_health) ----------------------------------------------------

def test_stall_watch_counts_only_stall_bounds_and_progress_clears_it():
    watch = expert_group.StallWatch()
    assert watch.verdict(10.0) is None
    watch.expired("total", 1.0)  # a request that was progressing hit its total cap: not a stall
    assert watch.verdict(10.0) is None
    watch.expired("first_token", 2.0)
    watch.expired("inter_token", 3.0)  # the stall started at the first one
    assert watch.verdict(10.0).startswith("hung: a request expired at a stall bound 8s ago")
    watch.progress(11.0)
    assert watch.verdict(12.0) is None


def test_a_group_that_stalls_fails_its_health_check_and_refuses_requests():
    async def scenario():
        group, local, _ = make_group()
        await group.check_health()  # healthy to begin with
        local.hang_first = True
        items = await drain(group.generate(request(0)))  # rank 0 never sends a token
        try:
            await group.check_health()
        except expert_group.GroupBroken as exc:
            return items, str(exc), await drain(group.generate(request(2)))
        raise AssertionError("a stalled group passed its health check")

    items, reason, refused = asyncio.run(asyncio.wait_for(scenario(), GUARD_S))
    assert isinstance(items[0], WaitExpired) and items[0].wait == "first_token"
    assert reason.startswith("hung: a request expired at a stall bound")
    assert len(refused) == 1 and refused[0].retriable and "unavailable" in refused[0].message


def test_progress_after_an_expiry_keeps_the_group_healthy():
    async def scenario():
        group, local, _ = make_group()
        local.hang_first = True
        await drain(group.generate(request(0)))  # rank 0: expires
        local.hang_first = False
        await drain(group.generate(request(2)))  # and then serves: it was one slow request
        await group.check_health()
        return group

    assert not asyncio.run(asyncio.wait_for(scenario(), GUARD_S))._broken


def test_a_remote_rank_that_does_not_answer_its_health_check_breaks_the_group(monkeypatch):
    monkeypatch.setattr(expert_group, "RANK_HEALTH_TIMEOUT_S", 0.2)  # 20 s in production

    async def scenario():
        group, _, _ = make_group()

        async def never():
            await asyncio.Event().wait()

        group._remote[0].check_health = _Method(never)  # rank 1's actor is alive but its loop is stuck
        started = time.monotonic()
        try:
            await group.check_health()
        except expert_group.GroupBroken as exc:
            return str(exc), time.monotonic() - started
        raise AssertionError("an unresponsive rank passed the group's health check")

    reason, elapsed_s = asyncio.run(asyncio.wait_for(scenario(), GUARD_S))
    assert reason == "rank 1 did not answer its health check within 0.2s"
    assert elapsed_s < 0.2 + SLACK_S
