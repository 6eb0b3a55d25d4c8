"""Best-effort fields of a report: a source that cannot answer gives the field's empty value.

Expert load and placement are observations: a rank whose engine cannot report them (an engine
without our worker extension, a vLLM that moved what it reads, a rank restarting) must not take
the report's other fields with it, such as the KV counters the autoscaler reads from the same
stats call. The first failure of each (source, field) is a warning; repeats, every export
period, go to debug.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


class ObservedFields:
    def __init__(self, log: logging.Logger):
        self._log = log
        self._warned: set[tuple[str, str]] = set()

    async def get(self, source: str, field: str, read: Callable[[], Awaitable[T]], empty: T) -> T:
        """`await read()`, or `empty` when it raises (logged as above)."""
        try:
            return await read()
        except Exception as exc:
            level = logging.DEBUG if (source, field) in self._warned else logging.WARNING
            self._warned.add((source, field))
            self._log.log(level, "%s cannot report %s (%s: %s); reporting it empty", source, field,
                          type(exc).__name__, str(exc)[:300])
            return empty
