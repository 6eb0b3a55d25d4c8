"""Replay a trace against a backend on its arrival schedule and record each request.

Open loop: request i is sent at trace[i].arrival_s after the start whether or not
earlier requests have finished (unless `max_concurrency` caps requests in flight,
in which case later requests wait and their `start_s` slips past `scheduled_s`).

A backend is anything with `stream(request)` yielding, per token arrival, the number
of tokens that arrived (an int > 0), and optionally, last, a `StreamUsage` with the
server's own token counts. The HTTP client below is one backend; an in-process engine
can be another and reuses the same scheduling and recording.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol, Sequence

import httpx
from tqdm import tqdm

from benchmarks.loadgen.stats import RequestRecord
from benchmarks.loadgen.trace import TraceRequest


@dataclass(frozen=True)
class StreamUsage:
    """Server-reported token counts; overrides the counts summed from arrivals."""

    prompt_tokens: int | None
    completion_tokens: int | None


class Backend(Protocol):
    def stream(self, request: TraceRequest) -> AsyncIterator[int | StreamUsage]:
        """Send `request`; yield token counts as they arrive; raise on failure."""
        ...


class BackendError(Exception):
    """The backend answered, but with an error (HTTP status, error event, bad stream)."""


# --- SSE parsing (pure) -------------------------------------------------------

DONE = "[DONE]"


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """One SSE line -> decoded JSON payload, DONE, or None for non-data lines."""
    line = line.strip()
    if not line.startswith("data:"):
        return None  # blank separators, comments (": ping"), event/id fields
    data = line[len("data:") :].strip()
    if data == DONE:
        return DONE
    payload = json.loads(data)
    if not isinstance(payload, dict):
        raise BackendError(f"SSE data is not a JSON object: {data[:200]}")
    return payload


def chunk_token_count(chunk: dict[str, Any]) -> int:
    """Tokens carried by one /v1/completions chunk; 0 for usage-only/finish chunks."""
    count = 0
    for choice in chunk.get("choices") or []:
        token_ids = choice.get("token_ids")
        if token_ids:
            count += len(token_ids)
        elif choice.get("text"):
            count += 1  # one chunk per decode step when the server sends no ids
    return count


def chunk_usage(chunk: dict[str, Any]) -> StreamUsage | None:
    usage = chunk.get("usage")
    if not usage:
        return None
    return StreamUsage(usage.get("prompt_tokens"), usage.get("completion_tokens"))


# --- HTTP backend -------------------------------------------------------------


class HttpBackend:
    """OpenAI-compatible streaming `/v1/completions` over one shared httpx client."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, *, token_ids: bool = True) -> None:
        self._client = client
        self._url = base_url.rstrip("/") + "/v1/completions"
        self._model = model
        # Ask for token ids (a vLLM and moe-serve extension): byte-level tokens that end
        # mid-character stream as empty text, so counting text chunks would undercount.
        self._token_ids = token_ids

    def payload(self, request: TraceRequest) -> dict[str, Any]:
        return {
            "model": self._model,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "stream": True,
            # Fixed output lengths: the trace decides how long each answer is.
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
            **({"return_token_ids": True} if self._token_ids else {}),
        }

    async def stream(self, request: TraceRequest) -> AsyncIterator[int | StreamUsage]:
        async with self._client.stream("POST", self._url, json=self.payload(request)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                raise BackendError(f"HTTP {resp.status_code}: {body[:200]}")
            async for line in resp.aiter_lines():
                event = parse_sse_line(line)
                if event is None:
                    continue
                if event == DONE:
                    return
                assert isinstance(event, dict)
                if "error" in event:
                    raise BackendError(f"error event: {json.dumps(event['error'])[:200]}")
                count = chunk_token_count(event)
                if count:
                    yield count
                usage = chunk_usage(event)
                if usage is not None:
                    yield usage
        raise BackendError("stream ended before data: [DONE]")


# --- scheduling and recording -------------------------------------------------


async def _run_one(
    backend: Backend,
    request: TraceRequest,
    t0: float,
    timeout_s: float,
    semaphore: asyncio.Semaphore | None,
) -> RequestRecord:
    if semaphore is not None:
        await semaphore.acquire()
    try:
        start_s = time.perf_counter() - t0
        record = RequestRecord(
            request_id=request.request_id,
            scheduled_s=request.arrival_s,
            start_s=start_s,
            end_s=start_s,
            prompt_tokens=request.prompt_words,
        )
        usage: StreamUsage | None = None
        try:
            async with asyncio.timeout(timeout_s):
                async for item in backend.stream(request):
                    now_s = time.perf_counter() - t0
                    if isinstance(item, StreamUsage):
                        usage = item
                    elif item > 0:
                        record.token_times_s.append(now_s)
                        record.output_tokens += item
            if not record.token_times_s:
                raise BackendError("no tokens received")
            record.ok = True
        except TimeoutError:
            record.error = f"timeout after {timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - one bad request must not end the run
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        record.end_s = time.perf_counter() - t0
        if record.token_times_s:
            record.first_token_s = record.token_times_s[0]
        if usage is not None:
            if usage.prompt_tokens is not None:
                record.prompt_tokens = usage.prompt_tokens
            if usage.completion_tokens is not None:
                record.output_tokens = usage.completion_tokens
        return record
    finally:
        if semaphore is not None:
            semaphore.release()


async def run_trace_with_backend(
    backend: Backend,
    trace: Sequence[TraceRequest],
    *,
    timeout_s: float = 300.0,
    max_concurrency: int | None = None,
    show_progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send each request at its arrival_s; return records (trace order) and duration_s.

    duration_s runs from the first scheduled arrival to the last completion.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency}: must be >= 1 or None")
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(trace), desc="requests", file=sys.stderr, disable=not show_progress)
    tasks: list[asyncio.Task[RequestRecord]] = []
    t0 = time.perf_counter()
    try:
        for request in sorted(trace, key=lambda r: r.arrival_s):
            delay_s = request.arrival_s - (time.perf_counter() - t0)
            if delay_s > 0:
                await asyncio.sleep(delay_s)
            task = asyncio.create_task(_run_one(backend, request, t0, timeout_s, semaphore))
            task.add_done_callback(lambda _: progress.update(1))
            tasks.append(task)
        records = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()  # no-op for finished tasks; stops stragglers on Ctrl-C
        progress.close()
    duration_s = time.perf_counter() - t0
    return sorted(records, key=lambda r: r.request_id), duration_s


async def run_trace(
    base_url: str,
    model: str,
    trace: Sequence[TraceRequest],
    *,
    timeout_s: float = 300.0,
    max_concurrency: int | None = None,
    show_progress: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Replay `trace` against an OpenAI-compatible server at `base_url`."""
    # No connection cap beyond max_concurrency: httpx's default pool of 100 would
    # otherwise queue requests client-side and count that wait as server latency.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=None)
    # trust_env=False: a benchmark must hit base_url directly, never via an env proxy.
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s), limits=limits, trust_env=False
    ) as client:
        backend = HttpBackend(client, base_url, model)
        return await run_trace_with_backend(
            backend,
            trace,
            timeout_s=timeout_s,
            max_concurrency=max_concurrency,
            show_progress=show_progress,
        )
