"""Fakes with the real interfaces of the ingress's collaborators, and HTTP helpers, shared by
the ingress tests. FakeEngine has HandleEngineClient's interface (stream() yields TokenDelta /
EngineFailure, health() raises when unhealthy), so the
ingress runs exactly the code it runs under Serve, minus Ray. The front end (vLLM's render and
derender) is the real one, on the tiny checkpoint."""

import asyncio
import functools
import json
from typing import Any
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from deployments.frontend.openai_ingress import OpenAIIngress
from deployments.records import EngineFailure, EngineRequest, TokenDelta
from deployments.frontend.tokenizer import PromptTokenizer


MAX_MODEL_LEN = 64
MODEL = {"name": "m", "path": "unused", "max_model_len": MAX_MODEL_LEN, "dtype": "bfloat16"}
HTTP = {"max_request_bytes": 4096}
BLOCK = object()  # in a script: wait forever (until cancelled)


@functools.cache
def front_end(tool_parser: str | None = None):
    """vLLM's real render/derender front end on the tiny checkpoint (built once per process and
    parser: tokenizer and config only, no weights, a few seconds)."""
    from cluster.checkpoints import ensure_checkpoint
    from deployments.frontend.render import VLLMFrontEnd

    return VLLMFrontEnd.from_model(MODEL, str(ensure_checkpoint("tiny-qwen3-moe", quiet=True)),
                                   {"tool_parser": tool_parser})


def tokenizer() -> PromptTokenizer:
    """The ingress's tokenizer (the front end's): what the expected prompt ids are computed with."""
    return PromptTokenizer(front_end().tokenizer)


@dataclass
class StreamLog:
    """What happened to one stream the fake engine served."""

    request: EngineRequest
    yielded: int = 0  # items handed to the consumer
    exhausted: bool = False
    closed_early: bool = False  # GeneratorExit: the consumer called aclose()
    cancelled: bool = False
    finalized: bool = False


@dataclass
class FakeEngine:
    """A script of items per request: TokenDelta, EngineFailure, an Exception to raise, or BLOCK."""

    script: list = field(default_factory=list)
    health_error: Exception | None = None
    streams: list[StreamLog] = field(default_factory=list)
    health_timeouts: list[float] = field(default_factory=list)

    async def stream(self, request: EngineRequest, **_options: Any) -> AsyncIterator[TokenDelta | EngineFailure]:
        log = StreamLog(request)
        self.streams.append(log)
        try:
            for item in self.script:
                if item is BLOCK:
                    await asyncio.Event().wait()
                elif isinstance(item, Exception):
                    raise item
                else:
                    log.yielded += 1
                    yield item
            log.exhausted = True
        except GeneratorExit:
            log.closed_early = True
            raise
        except asyncio.CancelledError:
            log.cancelled = True
            raise
        finally:
            log.finalized = True

    async def health(self, timeout_s: float) -> None:
        self.health_timeouts.append(timeout_s)
        if self.health_error is not None:
            raise self.health_error



def deltas(*texts: str, finish: str = "stop", prompt_tokens: int = 0) -> list[TokenDelta]:
    """One delta per text, one token id per delta (id 10, 11, ...), the last one finishing."""
    items = []
    for i, text in enumerate(texts):
        items.append(TokenDelta(text, [10 + i], finish if i == len(texts) - 1 else None, prompt_tokens, i + 1))
    return items


HELLO = deltas("Hello", " big", " world", finish="length")


class FakeMetricsBackend:
    """ray.util.metrics' interface, recording into `records`: (kind, name, value, tags)."""

    def __init__(self):
        self.records: list[tuple[str, str, float, dict]] = []
        backend = self

        class _Metric:
            def __init__(self, name, description="", tag_keys=(), boundaries=None):
                self.name, self.tag_keys = name, tuple(tag_keys)

            def _record(self, kind, value, tags):
                assert set(tags) == set(self.tag_keys), (self.name, tags, self.tag_keys)
                backend.records.append((kind, self.name, value, dict(tags)))

        class Counter(_Metric):
            def inc(self, value=1.0, tags=None):
                self._record("inc", value, tags or {})

        class Gauge(_Metric):
            def set(self, value, tags=None):
                self._record("set", value, tags or {})

        class Histogram(_Metric):
            def observe(self, value, tags=None):
                self._record("observe", value, tags or {})

        self.Counter, self.Gauge, self.Histogram = Counter, Gauge, Histogram

    def values(self, name: str, **tags) -> list[float]:
        return [v for _, n, v, t in self.records if n == name and tags.items() <= t.items()]


def make_client(engine: FakeEngine, metrics_backend: FakeMetricsBackend | None = None, http: dict = HTTP,
                **ingress_options: Any) -> tuple[TestClient, OpenAIIngress]:
    from monitoring.exporter import MetricsExporter

    exporter = MetricsExporter(backend=metrics_backend or FakeMetricsBackend())
    ingress = OpenAIIngress(engine, MODEL, http, model_path="unused", metrics=exporter, front=front_end(),
                            **ingress_options)

    async def endpoint(request):
        return await ingress(request)

    app = Starlette(routes=[Route("/{path:path}", endpoint, methods=["GET", "POST", "PUT", "DELETE"])])
    return TestClient(app), ingress


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(script=list(HELLO))


@pytest.fixture
def client(engine) -> TestClient:
    with make_client(engine)[0] as c:
        yield c


def sse_events(text: str) -> list:
    """Decode an SSE body into JSON payloads, with "[DONE]" kept as the string."""
    assert text.endswith("\n\n")
    events = []
    for block in text.strip("\n").split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response, status: int, code: str | None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    assert error["message"]
    return error
