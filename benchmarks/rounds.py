"""Shared by the layout benchmarks: the median of one metric over measured rounds."""

from __future__ import annotations

import statistics


def median_at(rounds: list[dict], path: tuple[str, ...]) -> float:
    """Median of `round[path[0]][path[1]]...` over rounds, ignoring rounds without a value."""
    values = []
    for measured in rounds:
        value = measured
        for key in path:
            value = value[key]
        values.append(value)
    return statistics.median(v for v in values if v is not None)
