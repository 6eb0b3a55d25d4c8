"""Client: real HTTP against a local SSE server, and scheduling with fake backends."""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks.loadgen.client import (
    StreamUsage,
    parse_sse_line,
    run_trace,
    run_trace_with_backend,
)
from benchmarks.loadgen.stats import summarize
from benchmarks.loadgen.trace import TraceRequest

CHUNK_DELAY_S = 0.02
TEXT_CHUNKS = ["Hello", " there", "", " big", " world"]  # "" must not count as a token


def chunk(text: str | None = None, usage: dict | None = None, finish: str | None = None) -> bytes:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
    body = {"id": "cmpl-1", "object": "text_completion", "choices": choices, "usage": usage}
    return f"data: {json.dumps(body)}\n\n".encode()


class FakeCompletions(BaseHTTPRequestHandler):
    """Streams TEXT_CHUNKS, a finish chunk, a usage chunk, [DONE]; prompt picks failures."""

    payloads: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).payloads.append({"path": self.path, **payload})
        if payload["prompt"] == "fail":
            body = b'{"error": "boom"}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for text in TEXT_CHUNKS:
            time.sleep(CHUNK_DELAY_S)
            self.wfile.write(chunk(text))
            self.wfile.flush()
        self.wfile.write(chunk("", finish="length"))
        # Server-reported counts are authoritative (4 text chunks, 6 tokens).
        self.wfile.write(chunk(usage={"prompt_tokens": 7, "completion_tokens": 6}))
        if payload["prompt"] != "truncate":
            self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


@pytest.fixture
def server_url():
    FakeCompletions.payloads = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def req(i: int, prompt: str = "some words here", arrival_s: float = 0.0) -> TraceRequest:
    return TraceRequest(i, arrival_s, prompt, len(prompt.split()), 6, False)


def test_http_stream_records_tokens_and_timing(server_url):
    trace = [req(0), req(1, arrival_s=0.15), req(2, "fail"), req(3, "truncate")]
    records, duration_s = asyncio.run(
        run_trace(server_url, "tiny", trace, timeout_s=10, show_progress=False)
    )
    assert [r.request_id for r in records] == [0, 1, 2, 3]
    good, later, failed, truncated = records
    for r in (good, later):
        assert r.ok, r.error
        assert len(r.token_times_s) == 4  # the empty-text chunk is not a token arrival
        assert r.output_tokens == 6 and r.prompt_tokens == 7  # from the usage chunk
        assert r.start_s <= r.first_token_s <= r.end_s
        assert 0 < r.ttft_ms <= r.e2e_ms
        assert min(r.itl_gaps_ms) >= CHUNK_DELAY_S * 1000 * 0.5
    assert later.start_s >= 0.15  # waited for its arrival time
    assert not failed.ok and "HTTP 500" in failed.error and "boom" in failed.error
    assert not truncated.ok and "[DONE]" in truncated.error
    assert duration_s >= later.end_s

    sent = FakeCompletions.payloads[0]
    assert sent["path"] == "/v1/completions"
    assert sent["model"] == "tiny" and sent["max_tokens"] == 6
    assert sent["stream"] is True and sent["ignore_eos"] is True
    assert sent["temperature"] == 0
    assert sent["stream_options"] == {"include_usage": True}

    s = summarize(records, duration_s, slo_ttft_ms=10_000, slo_itl_ms=10_000)
    assert (s.num_ok, s.num_failed, s.num_slo_met) == (2, 2, 2)


def test_unreachable_server_is_recorded_not_raised():
    import socket

    with socket.socket() as sock:  # grab a free port, then close it: nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    records, _ = asyncio.run(
        run_trace(f"http://127.0.0.1:{port}", "m", [req(0)], timeout_s=5, show_progress=False)
    )
    assert not records[0].ok and "Connect" in records[0].error


def test_parse_sse_line():
    assert parse_sse_line("") is None
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("data: [DONE]") == "[DONE]"
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}


class FakeBackend:
    """Implements the Backend protocol; tracks requests in flight."""

    def __init__(self, tokens_per_arrival: int = 1, arrivals: int = 3, delay_s: float = 0.01):
        self.tokens_per_arrival = tokens_per_arrival
        self.arrivals = arrivals
        self.delay_s = delay_s
        self.in_flight = 0
        self.max_in_flight = 0

    async def stream(self, request):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if request.prompt == "raise":
                raise RuntimeError("engine exploded")
            for _ in range(self.arrivals):
                await asyncio.sleep(self.delay_s)
                yield self.tokens_per_arrival
            yield StreamUsage(prompt_tokens=None, completion_tokens=None)
        finally:
            self.in_flight -= 1


def test_backend_counts_multi_token_arrivals_and_caps_concurrency():
    backend = FakeBackend(tokens_per_arrival=2)
    trace = [req(i) for i in range(6)]
    records, _ = asyncio.run(
        run_trace_with_backend(backend, trace, max_concurrency=2, show_progress=False)
    )
    assert backend.max_in_flight == 2
    assert all(r.ok and r.output_tokens == 6 and len(r.token_times_s) == 3 for r in records)
    assert all(r.prompt_tokens == 3 for r in records)  # usage had none: trace words kept


def test_burst_without_cap_runs_everything_concurrently_and_errors_are_isolated():
    backend = FakeBackend()
    trace = [req(i) for i in range(5)] + [req(5, "raise")]
    records, _ = asyncio.run(run_trace_with_backend(backend, trace, show_progress=False))
    assert backend.max_in_flight == 6
    assert [r.ok for r in records] == [True] * 5 + [False]
    assert records[5].error == "RuntimeError: engine exploded"


def test_per_request_timeout():
    backend = FakeBackend(arrivals=50, delay_s=0.02)
    records, duration_s = asyncio.run(
        run_trace_with_backend(backend, [req(0)], timeout_s=0.1, show_progress=False)
    )
    assert not records[0].ok and records[0].error == "timeout after 0.1 s"
    assert duration_s < 0.5
    assert backend.in_flight == 0  # the stream was closed, not leaked
