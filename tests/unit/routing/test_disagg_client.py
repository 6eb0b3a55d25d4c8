"""DisaggregatedEngineClient with fake Serve handles: the prefill -> decode hand-off, and the
release of a prefill's lease when decode never starts."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from deployments import disagg_client as dc
from deployments.records import EngineFailure, EngineRequest, PrefillResult, SamplingSpec, TokenDelta
from kv_transfer.params import TransferParams

PARAMS = TransferParams("127.0.0.1", 1, "engine-p", "p-1", (0, 1), 20, 16, 4e9)


class _Method:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        return self._fn(*args)


class FakePrefillHandle:
    def __init__(self, result):
        self.result = result
        self.released: list[dict] = []
        self.prefill = _Method(self._prefill)
        self.release = _Method(self._release)
        self.check_health = _Method(self._ok)
        self.calls = 0

    async def _prefill(self, request):
        self.calls += 1
        if isinstance(self.result, Exception):
            raise self.result
        return self.result

    async def _release(self, params):
        self.released.append(params)

    async def _ok(self):
        return None


class FakeDecodeClient:
    """HandleEngineClient's interface (what DisaggregatedEngineClient wraps the decode handle in)."""

    def __init__(self, script):
        self.script = script
        self.requests: list[EngineRequest] = []

    async def stream(self, request, **_options):
        self.requests.append(request)
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            if item == "block":
                await asyncio.Event().wait()
            yield item

    async def health(self, timeout_s):
        return None


def _client(prefill, decode, monkeypatch, **kwargs):
    monkeypatch.setattr(dc, "HandleEngineClient", lambda handle: handle)
    return dc.DisaggregatedEngineClient(prefill, decode, **kwargs)


REQUEST = EngineRequest("r-1", [1, 2, 3], SamplingSpec(max_tokens=4))
DELTA = TokenDelta("hi", [7], "length", 3, 1)


async def _drain(stream):
    return [item async for item in stream]


def test_decode_gets_the_prefill_params(monkeypatch):
    prefill = FakePrefillHandle(PrefillResult(PARAMS, 3, 0.01, cached_tokens=2))
    decode = FakeDecodeClient([DELTA])
    out = asyncio.run(_drain(_client(prefill, decode, monkeypatch).stream(REQUEST)))
    # Decode loaded the whole prompt; the tokens the request did not compute are the prefill's.
    assert out == [replace(DELTA, cached_tokens=2)]
    assert decode.requests[0].pull == PARAMS
    assert decode.requests[0].prompt_token_ids == [1, 2, 3]
    assert prefill.released == []  # decode pulled and released itself


def test_prefill_failure_is_passed_on_and_decode_never_called(monkeypatch):
    failure = EngineFailure("no", retriable=True)
    decode = FakeDecodeClient([DELTA])
    out = asyncio.run(_drain(_client(FakePrefillHandle(failure), decode, monkeypatch).stream(REQUEST)))
    assert out == [failure] and decode.requests == []


def test_prefill_replica_crash_becomes_a_retriable_failure(monkeypatch):
    decode = FakeDecodeClient([DELTA])
    out = asyncio.run(_drain(_client(FakePrefillHandle(RuntimeError("actor died")), decode, monkeypatch)
                             .stream(REQUEST)))
    assert isinstance(out[0], EngineFailure) and out[0].retriable and "actor died" in out[0].message


def test_lease_released_when_the_caller_leaves_before_decode_yields(monkeypatch):
    prefill = FakePrefillHandle(PrefillResult(PARAMS, 3, 0.01))
    decode = FakeDecodeClient(["block"])

    async def scenario():
        task = asyncio.ensure_future(_drain(_client(prefill, decode, monkeypatch).stream(REQUEST)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)  # the release is sent in the background

    asyncio.run(scenario())
    assert [p.remote_request_id for p in prefill.released] == ["p-1"]


def test_fault_injection_only_when_allowed(monkeypatch):
    for allowed, expected in ((True, True), (False, False)):
        prefill = FakePrefillHandle(PrefillResult(PARAMS, 3, 0.01))
        decode = FakeDecodeClient([DELTA])
        client = _client(prefill, decode, monkeypatch, allow_fault_injection=allowed)
        asyncio.run(_drain(client.stream(REQUEST, inject_transfer_failure=True)))
        assert decode.requests[0].pull.inject_failure is expected


def test_caller_leaving_during_prefill_releases_the_lease_the_prefill_ends_up_holding(monkeypatch):
    """Cancelling a Serve call is best effort; the prefill may complete anyway. The client must
    not drop its result: it lets the prefill finish and releases the lease (seen leaking in CI)."""
    gate = asyncio.Event()

    class SlowPrefill(FakePrefillHandle):
        async def _prefill(self, request):
            await gate.wait()
            return self.result

    prefill = SlowPrefill(PrefillResult(PARAMS, 3, 0.01))
    decode = FakeDecodeClient([DELTA])
    client = _client(prefill, decode, monkeypatch)

    async def scenario():
        consumer = asyncio.ensure_future(_drain(client.stream(REQUEST)))
        await asyncio.sleep(0.01)
        consumer.cancel()  # the HTTP client went away while its prompt was being prefilled
        with pytest.raises(asyncio.CancelledError):
            await consumer
        assert prefill.released == []  # nothing to release yet: the prefill is still running
        gate.set()
        for _ in range(10):
            await asyncio.sleep(0)
        return prefill.released

    released = asyncio.run(scenario())
    assert [p.remote_request_id for p in released] == ["p-1"]
    assert decode.requests == []  # decode never admitted it


def test_caller_leaving_during_a_failing_prefill_releases_nothing(monkeypatch):
    gate = asyncio.Event()

    class FailingPrefill(FakePrefillHandle):
        async def _prefill(self, request):
            await gate.wait()
            raise RuntimeError("replica died")

    prefill = FailingPrefill(None)
    client = _client(prefill, FakeDecodeClient([DELTA]), monkeypatch)

    async def scenario():
        consumer = asyncio.ensure_future(_drain(client.stream(REQUEST)))
        await asyncio.sleep(0.01)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        gate.set()
        for _ in range(10):
            await asyncio.sleep(0)
        return prefill.released

    assert asyncio.run(scenario()) == []


def test_a_prompt_below_the_local_prefill_threshold_skips_the_prefill_pool(monkeypatch):
    decisions = []
    prefill = FakePrefillHandle(PrefillResult(PARAMS, 3, 0.01))
    decode = FakeDecodeClient([DELTA])
    client = _client(prefill, decode, monkeypatch, local_prefill_below_tokens=4, on_decision=decisions.append)
    out = asyncio.run(_drain(client.stream(REQUEST)))  # a 3-token prompt
    assert out == [DELTA] and decisions == ["local_short_prompt"]
    assert decode.requests[0].pull is None and prefill.calls == 0
    client = _client(prefill, FakeDecodeClient([DELTA]), monkeypatch, local_prefill_below_tokens=3,
                     on_decision=decisions.append)
    asyncio.run(_drain(client.stream(REQUEST)))
    assert decisions == ["local_short_prompt", "remote"] and prefill.calls == 1


def test_with_no_prefill_replica_running_decode_prefills_the_prompt_itself(monkeypatch):
    """The prefill pool's only replica died and Serve is starting another: a remote prefill now
    would wait in the handle's queue for the new replica, up to the prefill bound. Decode
    computes the prompt itself (the same output); once a replica runs, prompts go remote again."""

    class PrefillRouter:
        curr_replicas: dict = {}

    router = PrefillRouter()
    decisions = []
    prefill = FakePrefillHandle(PrefillResult(PARAMS, 3, 0.01))
    decode = FakeDecodeClient([DELTA])
    client = _client(prefill, decode, monkeypatch, on_decision=decisions.append, prefill_router=lambda: router)
    assert asyncio.run(_drain(client.stream(REQUEST))) == [DELTA]
    assert decisions == ["prefill_unavailable"] and prefill.calls == 0 and decode.requests[0].pull is None
    router.curr_replicas = {"replica-2": object()}
    client = _client(prefill, FakeDecodeClient([DELTA]), monkeypatch, on_decision=decisions.append,
                     prefill_router=lambda: router)
    asyncio.run(_drain(client.stream(REQUEST)))
    assert decisions == ["prefill_unavailable", "remote"] and prefill.calls == 1


class FakeDecodeRouter:
    """The decode pool's router as the client sees it: decide() and the engines' block size."""

    def __init__(self, hit_blocks: int, block_size: int = 16):
        from deployments.routing.state import RouteDecision

        self.block_size = block_size
        self.decision = RouteDecision("decode-replica-b", "prefix", hit_blocks)
        self.asked: list[tuple[list[int], str | None]] = []

    def decide(self, prompt_token_ids, session_id=None):
        self.asked.append((prompt_token_ids, session_id))
        return self.decision


LONG = EngineRequest("r-2", list(range(100)), SamplingSpec(max_tokens=4), session_id="chat-1")


def test_decode_holding_most_of_the_prompt_prefills_it_itself_on_the_replica_chosen_first(monkeypatch):
    prefill = FakePrefillHandle(PrefillResult(PARAMS, 100, 0.01))
    decode = FakeDecodeClient([DELTA])
    router, decisions = FakeDecodeRouter(hit_blocks=5), []  # 80 of 100 tokens cached
    client = _client(prefill, decode, monkeypatch, local_hit_fraction=0.8, decode_router=lambda: router,
                     on_decision=decisions.append)
    assert asyncio.run(_drain(client.stream(LONG))) == [DELTA]
    assert prefill.calls == 0 and decisions == ["decode_holds_prefix"]
    assert decode.requests[0].route_to == "decode-replica-b" and decode.requests[0].pull is None
    assert router.asked == [(LONG.prompt_token_ids, "chat-1")]


def test_decode_holding_less_gets_a_remote_prefill_and_is_still_the_replica_chosen_first(monkeypatch):
    prefill = FakePrefillHandle(PrefillResult(PARAMS, 100, 0.01))
    decode = FakeDecodeClient([DELTA])
    router, decisions = FakeDecodeRouter(hit_blocks=4), []  # 64 of 100: below 0.8
    client = _client(prefill, decode, monkeypatch, local_hit_fraction=0.8, decode_router=lambda: router,
                     on_decision=decisions.append)
    asyncio.run(_drain(client.stream(LONG)))
    assert prefill.calls == 1 and decisions == ["remote"]
    assert decode.requests[0].route_to == "decode-replica-b" and decode.requests[0].pull == PARAMS


def test_without_the_setting_or_before_the_router_exists_decode_is_routed_at_the_call(monkeypatch):
    for kwargs in ({"decode_router": lambda: FakeDecodeRouter(hit_blocks=7)},   # setting off
                   {"local_hit_fraction": 0.8, "decode_router": lambda: None}):  # no router yet
        prefill = FakePrefillHandle(PrefillResult(PARAMS, 100, 0.01))
        decode = FakeDecodeClient([DELTA])
        asyncio.run(_drain(_client(prefill, decode, monkeypatch, **kwargs).stream(LONG)))
        assert prefill.calls == 1 and decode.requests[0].route_to is None


def _streamed_then_settled(prefill, decode, monkeypatch) -> list:
    """Every item of one P/D request, after its background release (if any) went out."""
    async def scenario():
        out = await _drain(_client(prefill, decode, monkeypatch).stream(REQUEST))
        await asyncio.sleep(0.05)  # the release is sent in the background
        return out

    return asyncio.run(scenario())


@pytest.mark.parametrize("failure", [
    EngineFailure("decode replica failed: ActorDiedError", retriable=True),
    EngineFailure("Requested sample logprobs of 100, which is greater than max allowed: 20", invalid_request=True),
], ids=["decode-died", "decode-refused-the-request"])
def test_a_decode_failure_as_the_first_item_releases_the_prefill_lease(monkeypatch, failure):
    """Decode that fails before any token may never have pulled: the prefill's blocks must not
    stay pinned until the lease runs out (each client retry would pin another lease)."""
    prefill = FakePrefillHandle(PrefillResult(PARAMS, 3, 0.01))
    decode = FakeDecodeClient([failure])

    assert _streamed_then_settled(prefill, decode, monkeypatch) == [failure]
    assert [p.remote_request_id for p in prefill.released] == ["p-1"]


def test_decode_failing_after_its_first_token_releases_the_lease_once_more(monkeypatch):
    prefill = FakePrefillHandle(PrefillResult(PARAMS, 3, 0.01))
    decode = FakeDecodeClient([replace(DELTA, finish_reason=None), EngineFailure("died mid-stream", retriable=True)])

    assert len(_streamed_then_settled(prefill, decode, monkeypatch)) == 2
    # Decode pulled (it produced a token), but died: its own release may never have gone out.
    assert [p.remote_request_id for p in prefill.released] == ["p-1"]


def test_stream_closed_after_its_first_token_releases_the_lease_once_more(monkeypatch):
    """The ingress's inter-token bound (or a client leaving) closes the stream after decode's
    first token: a decode that dies then may have pulled without its own release getting out."""
    prefill = FakePrefillHandle(PrefillResult(PARAMS, 3, 0.01))
    decode = FakeDecodeClient([replace(DELTA, finish_reason=None), "block"])

    async def scenario():
        stream = _client(prefill, decode, monkeypatch).stream(REQUEST)
        first = await anext(stream)
        await stream.aclose()
        await asyncio.sleep(0.05)
        return first

    assert asyncio.run(scenario()).token_ids == [7]
    assert [p.remote_request_id for p in prefill.released] == ["p-1"]


def test_a_finished_decode_leaves_the_release_to_its_connector(monkeypatch):
    prefill = FakePrefillHandle(PrefillResult(PARAMS, 3, 0.01))
    decode = FakeDecodeClient([replace(DELTA, finish_reason=None), DELTA])

    assert len(_streamed_then_settled(prefill, decode, monkeypatch)) == 2
    assert prefill.released == []


def test_a_decode_that_recomputed_after_its_pull_failed_releases_the_lease_once_more(monkeypatch):
    """What broke the pull may have lost decode's own release too (CI: both failed on one
    closed connection and the lease was left to expire)."""
    from kv_transfer.params import LoadTiming

    prefill = FakePrefillHandle(PrefillResult(PARAMS, 3, 0.01))
    final = replace(DELTA, kv_load=LoadTiming(pull_s=0.2, pull_blocks=2, pull_failed=True))
    decode = FakeDecodeClient([replace(DELTA, finish_reason=None), final])

    assert len(_streamed_then_settled(prefill, decode, monkeypatch)) == 2
    assert [p.remote_request_id for p in prefill.released] == ["p-1"]
