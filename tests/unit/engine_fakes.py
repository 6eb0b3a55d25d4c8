"""An engine with the real engine interface that records what its server asked of it (unit tests
of LLMServer: what reaches the engine, and in what form)."""

from __future__ import annotations

from deployments.records import TokenDelta


class RecordingEngine:
    """Answers every request with one token, keeping the EngineRequests it was given."""

    max_model_len = 2048

    def __init__(self):
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        yield TokenDelta("a", [1], "length", 3, 1)

    async def abort(self, request_id):
        pass

    def unfinished_requests(self):
        return 0

    def shutdown(self):
        pass


def recording_server():
    """An LLMServer over a RecordingEngine, without metrics: (server, engine)."""
    from deployments.engine.llm_server import LLMServer

    engine = RecordingEngine()
    server = LLMServer({"name": "m", "max_model_len": 2048}, {"stream_interval_ms": 0}, "/ckpt",
                       engine_factory=lambda *a, **k: engine, metrics=False)
    return server, engine
