"""LLMServer.prefill with a fake engine: a caller that leaves never leaks the prefill's lease."""

from __future__ import annotations

import asyncio
from dataclasses import replace
import time

import pytest

from deployments.engine.llm_server import LLMServer
from deployments.records import EngineRequest, PrefillResult, SamplingSpec, TokenDelta
from kv_transfer.params import TransferParams, handed_over
from tests.unit.ingress_fakes import FakeMetricsBackend

PARAMS = {"remote_host": "127.0.0.1", "remote_port": 9, "remote_engine_id": "e", "remote_request_id": "r-1-abcd1234",
          "remote_block_ids": [0], "remote_num_tokens": 3, "block_size_tokens": 16,
          "lease_deadline_unix_s": 4e9, "do_remote_prefill": True}


class GatedEngine:
    """VLLMEngine's interface: the prefill finishes (lease granted) when `gate` opens."""

    max_model_len = 2048

    def __init__(self):
        self.gate = asyncio.Event()
        self.aborted: list[str] = []

    async def generate(self, request):
        await self.gate.wait()
        yield TokenDelta("x", [5], "length", len(request.prompt_token_ids), 1, kv_transfer_params=PARAMS)

    async def abort(self, request_id):
        self.aborted.append(request_id)

    def unfinished_requests(self):
        return 0

    def shutdown(self):
        pass


class RecordingKVClient:
    def __init__(self):
        self.released: list[str] = []
        self.grants: list[bytes] = []

    def release(self, host, port, request_id, timeout_s, block_ids=(), grant=b""):
        self.released.append(request_id)
        self.grants.append(grant)


def make_server():
    engine = GatedEngine()
    server = LLMServer({"name": "m", "max_model_len": 2048}, {"stream_interval_ms": 0}, "/ckpt",
                       kv_transfer={"backend": "tcp", "host": "127.0.0.1", "lease_s": 30, "transfer_timeout_s": 5,
                                    "failure_policy": "recompute"},
                       engine_factory=lambda *a, **k: engine, metrics_backend=FakeMetricsBackend())
    server._kv_client = RecordingKVClient()
    return server, engine


def test_a_finished_prefill_returns_its_transfer_params():
    server, engine = make_server()
    engine.gate.set()
    result = asyncio.run(server.prefill(EngineRequest("r-1", [1, 2, 3], SamplingSpec(max_tokens=8))))
    assert isinstance(result, PrefillResult)
    # Typed as it leaves the prefill, with the lease time left read off its deadline.
    expected = TransferParams.from_engine(handed_over(PARAMS, time.time()))
    assert replace(result.transfer_params, lease_remaining_s=None) == replace(expected, lease_remaining_s=None)
    assert abs(expected.lease_remaining_s - result.transfer_params.lease_remaining_s) < 5
    assert server._kv_client.released == []


def test_a_cancelled_prefill_runs_to_its_end_and_releases_its_lease():
    server, engine = make_server()

    async def scenario():
        call = asyncio.ensure_future(server.prefill(EngineRequest("r-1", [1, 2, 3], SamplingSpec(max_tokens=8))))
        await asyncio.sleep(0.01)
        call.cancel()  # Serve cancels downstream calls of a request whose client left
        with pytest.raises(asyncio.CancelledError):
            await call
        engine.gate.set()  # the engine finishes the prompt and grants the lease anyway
        for _ in range(50):
            await asyncio.sleep(0.01)
            if server._kv_client.released:
                break

    asyncio.run(scenario())
    assert server._kv_client.released == ["r-1-abcd1234"]
    assert engine.aborted == []  # not aborted: an abort could race the grant and lose the lease
