"""Open-loop load generator for OpenAI-compatible completion servers.

`trace` builds a deterministic request schedule, `client` replays it against a
backend (HTTP or in-process), `stats` turns per-request records into a summary.
"""

from benchmarks.loadgen.stats import RequestRecord, Summary, format_table, summarize
from benchmarks.loadgen.trace import LengthSpec, TraceRequest, TraceSpec, make_trace

__all__ = [
    "LengthSpec",
    "RequestRecord",
    "Summary",
    "TraceRequest",
    "TraceSpec",
    "format_table",
    "make_trace",
    "summarize",
]
