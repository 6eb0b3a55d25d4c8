"""LLMServer's expert observations: read through the engine's worker extension, one field at a
time, so a field the engine cannot report leaves the others."""

from __future__ import annotations

import asyncio
import logging

from deployments.engine.llm_server import LLMServer
from tests.unit.ingress_fakes import FakeMetricsBackend


class ObservedEngine:
    """VLLMEngine's collective_rpc over fake workers: one answer per worker, or the error a
    worker without the method raises."""

    def __init__(self, answers: dict[str, list]):
        self.answers = answers

    async def collective_rpc(self, method):
        if method not in self.answers:
            raise AttributeError(f"'Worker' object has no attribute '{method}'")
        return self.answers[method]

    def shutdown(self):
        pass


def make_server(answers):
    return LLMServer({"name": "m"}, {"stream_interval_ms": 0}, "/ckpt", engine_factory=lambda *a, **k: ObservedEngine(answers),
                     metrics_backend=FakeMetricsBackend(), pool="decode", rank=1)


def test_placement_keeps_the_fields_the_engine_can_report(caplog):
    server = make_server({"parameter_bytes": [{"total": 10, "routed_experts": 6}]})
    with caplog.at_level(logging.WARNING, logger="deployments.engine.llm_server"):
        first = asyncio.run(server.placement())
        asyncio.run(server.placement())
    assert first["layers"] == [] and first["parameter_bytes"] == {"total": 10, "routed_experts": 6}
    assert first["process_id"] and "node_id" in first
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "decode rank 1 cannot report local_experts" in messages[0]


def test_routed_tokens_are_summed_over_the_engines_workers():
    server = make_server({"routed_tokens_per_expert": [{4: 2, 5: 1}, {4: 1}]})
    assert asyncio.run(server.routed_tokens_per_expert()) == {4: 3, 5: 1}
