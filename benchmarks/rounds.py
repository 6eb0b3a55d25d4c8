"""Shared by the layout benchmarks: the median of one metric over measured rounds."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path


def median_at(rounds: list[dict], path: tuple[str, ...]) -> float:
    """Median of `round[path[0]][path[1]]...` over rounds, ignoring rounds without a value."""
    values = []
    for measured in rounds:
        value = measured
        for key in path:
            value = value[key]
        values.append(value)
    return statistics.median(v for v in values if v is not None)


def write_results(out: str, args, table: dict, raw: dict) -> Path:
    """The results file every layout benchmark writes: how it was run (command line, time, CPU
    count, arguments), its printed table and every round's raw numbers; says where."""
    path = Path(out)
    path.write_text(json.dumps({"command": " ".join(sys.argv), "when": time.strftime("%Y-%m-%d %H:%M:%S"),
                                "cpus": os.cpu_count(), "args": vars(args), "table": table, "raw": raw},
                               indent=1, default=str))
    print(f"\nwrote {path}")
    return path
