"""Hooks for the whole suite: failures reported the moment they happen, and a time budget."""

from __future__ import annotations

import os
import sys
import time

import pytest

# CI stops the whole run at 90 minutes (set-up included) and then prints nothing of pytest's
# summary. Past this budget the remaining tests fail at once, naming the budget, so a run that
# went slow still ends with a report of what passed, what failed and why.
BUDGET_S = float(os.environ.get("MOE_SERVE_TEST_BUDGET_S", 80 * 60))
_STARTED = time.monotonic()


def remaining_budget_s() -> float:
    """Seconds of the suite's time budget left (negative: over it)."""
    return BUDGET_S - (time.monotonic() - _STARTED)


def pytest_runtest_setup(item):
    spent = time.monotonic() - _STARTED
    if spent > BUDGET_S:
        pytest.fail(f"the suite is over its time budget ({spent / 60:.0f} of {BUDGET_S / 60:.0f} min; "
                    "MOE_SERVE_TEST_BUDGET_S): not started", pytrace=False)


def pytest_runtest_logreport(report):
    """Print a failure's cause the moment it happens: when CI is cut off by its time limit,
    pytest's summary at the end never comes, and these lines are all that says why."""
    if report.failed:
        text = str(report.longrepr)
        print(f"\n[failed] {report.nodeid} ({report.when}):\n{text[-3000:]}\n", file=sys.stderr, flush=True)
