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


def test_a_call_cancelled_as_its_replica_is_assigned_is_cancelled_on_the_replica():
    async def scenario():
        handle = FakeHandle()
        consumer = asyncio.ensure_future(_consume(HandleEngineClient(handle)))
        await asyncio.sleep(0)  # waiting for the assignment
        response = handle.responses[0]
        replica_result = FakeReplicaResult()
        response.assignment.set_result(replica_result)
        consumer.cancel()  # before the consumer resumed: it never fetches its replica result
        await asyncio.gather(consumer, return_exceptions=True)
        await asyncio.sleep(0.01)  # the follow-up runs in the background
        return response, replica_result

    response, replica_result = asyncio.run(scenario())
    assert response._replica_result is replica_result  # fetched by the follow-up
    assert replica_result.cancelled


def test_a_call_cancelled_before_assignment_never_reaches_a_replica():
    async def scenario():
        handle = FakeHandle()
        consumer = asyncio.ensure_future(_consume(HandleEngineClient(handle)))
        await asyncio.sleep(0)
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
        await asyncio.sleep(0.01)
        return handle.responses[0]

    response = asyncio.run(scenario())
    assert response.assignment.cancelled() and response._replica_result is None
