"""A Serve call cancelled just as its replica was assigned is still cancelled on the replica
(deployments/engine_client.cancel_call). The fake response behaves as Serve's
DeploymentResponseGenerator with the router on the caller's loop: cancel() reaches the replica
only once the response has fetched its replica result."""

from __future__ import annotations

import asyncio

from deployments.engine_client import HandleEngineClient
from deployments.records import EngineRequest, SamplingSpec


class FakeReplicaResult:
    def __init__(self):
        self.cancelled = False
        self.items: asyncio.Queue = asyncio.Queue()

    def cancel(self):
        self.cancelled = True

    async def __anext__(self):
        return await self.items.get()


class FakeServeResponse:
    def __init__(self):
        self.assignment: asyncio.Future = asyncio.get_running_loop().create_future()
        self._replica_result: FakeReplicaResult | None = None

    async def _fetch_future_result_async(self):
        if self._replica_result is None:
            self._replica_result = await self.assignment
        return self._replica_result

    def cancel(self):  # as Serve's, with the router on this loop
        self.assignment.cancel()
        if self._replica_result is not None:
            self._replica_result.cancel()

    def __aiter__(self):
        return self

    async def __anext__(self):
        replica_result = await self._fetch_future_result_async()
        return await replica_result.__anext__()


class FakeHandle:
    def __init__(self):
        self.responses: list[FakeServeResponse] = []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, _request):
        response = FakeServeResponse()
        self.responses.append(response)
        return response


REQUEST = EngineRequest("r-1", [1, 2, 3], SamplingSpec(max_tokens=8))


async def _consume(client):
    async for _ in client.stream(REQUEST):
        pass


def _scenario(assign):
    """Start a stream, let `assign(response)` run against it, cancel the consumer, settle."""
    async def run():
        handle = FakeHandle()
        consumer = asyncio.ensure_future(_consume(HandleEngineClient(handle)))
        await asyncio.sleep(0)  # waiting for the assignment
        response = handle.responses[0]
        result = await assign(response, consumer)
        await asyncio.gather(consumer, return_exceptions=True)
        await asyncio.sleep(0.01)
        return response, result

    return asyncio.run(run())


def test_a_call_cancelled_while_its_replica_is_being_assigned_is_cancelled_on_the_replica():
    """The race seen on the default manifest: the request is on its way to a replica when the
    caller goes; the assignment must finish and then be cancelled, not be cut off mid-way."""
    async def assign(response, consumer):
        consumer.cancel()
        await asyncio.sleep(0)
        assert not response.assignment.cancelled()  # the router's task was not cut off
        replica_result = FakeReplicaResult()
        response.assignment.set_result(replica_result)
        return replica_result

    _, replica_result = _scenario(assign)
    assert replica_result.cancelled


def test_a_call_cancelled_as_its_replica_is_assigned_is_cancelled_on_the_replica():
    async def assign(response, consumer):
        replica_result = FakeReplicaResult()
        response.assignment.set_result(replica_result)
        consumer.cancel()  # before the consumer resumed
        return replica_result

    response, replica_result = _scenario(assign)
    assert response._replica_result is replica_result and replica_result.cancelled


def test_a_call_whose_assignment_fails_has_nothing_to_cancel():
    async def assign(response, consumer):
        consumer.cancel()
        await asyncio.sleep(0)
        response.assignment.set_exception(RuntimeError("no replica"))
        return None

    response, _ = _scenario(assign)
    assert response._replica_result is None


def test_a_call_still_unassigned_after_the_grace_is_cancelled_in_the_router(monkeypatch):
    import deployments.engine_client as engine_client

    monkeypatch.setattr(engine_client, "ASSIGNMENT_GRACE_S", 0.01)

    async def assign(response, consumer):
        consumer.cancel()
        await asyncio.sleep(0.05)  # queued behind busy replicas past the grace
        return None

    response, _ = _scenario(assign)
    assert response.assignment.cancelled()  # nothing was sent; nothing runs


def test_background_work_is_held_until_it_ends_and_its_failure_is_logged(caplog):
    import gc
    import logging

    from deployments.background import Background

    async def scenario():
        background = Background(logging.getLogger("test-background"))
        gate = asyncio.get_running_loop().create_future()

        async def waits():
            await gate
            return "done"

        async def fails():
            raise RuntimeError("peer gone")

        held = background.spawn(waits(), "waiting work")
        background.spawn(fails(), "failing work")
        for _ in range(3):  # the failure, then its done callback
            await asyncio.sleep(0)
        gc.collect()
        assert len(background) == 1 and not held.done()
        gate.set_result(None)
        assert await held == "done"
        assert len(background) == 0

    with caplog.at_level(logging.WARNING, logger="test-background"):
        asyncio.run(scenario())
    assert "failing work failed: RuntimeError: peer gone" in caplog.text
