"""Hooks for the whole suite."""

from __future__ import annotations

import sys


def pytest_runtest_logreport(report):
    """Print a failure's cause the moment it happens: when CI is cut off by its time limit,
    pytest's summary at the end never comes, and these lines are all that says why."""
    if report.failed:
        text = str(report.longrepr)
        print(f"\n[failed] {report.nodeid} ({report.when}):\n{text[-3000:]}\n", file=sys.stderr, flush=True)
