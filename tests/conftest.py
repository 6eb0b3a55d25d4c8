"""Hooks for the whole suite: failures reported the moment they happen, a time budget, the
extended tier, and the time each module took."""

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
# Wall seconds per test module (setup, call and teardown): the table at the end of every run
# says where the suite's minutes went.
_MODULE_SECONDS: dict[str, float] = {}

EXTENDED_REASON = ("extended tier: re-proves on the real stack a path the default tier already covers, "
                   "at several minutes of engine starts; `bash scripts/test.sh --extended` runs it "
                   "(docs/testing.md)")


def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true", default=False,
                     help="also run the tests marked `extended` (docs/testing.md); "
                          "MOE_SERVE_EXTENDED=1 does the same")


def extended_tier(config) -> bool:
    return bool(config.getoption("--extended")) or os.environ.get("MOE_SERVE_EXTENDED") == "1"


def pytest_configure(config):
    global BUDGET_S
    # The extended tier is not bound by CI's limit; an explicit budget still wins.
    if extended_tier(config) and "MOE_SERVE_TEST_BUDGET_S" not in os.environ:
        BUDGET_S = 180 * 60


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    if extended_tier(config):
        return
    skip = pytest.mark.skip(reason=EXTENDED_REASON)
    for item in items:
        if item.get_closest_marker("extended") is not None:
            item.add_marker(skip)


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
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration
    if report.failed:
        text = str(report.longrepr)
        print(f"\n[failed] {report.nodeid} ({report.when}):\n{text[-3000:]}\n", file=sys.stderr, flush=True)


def pytest_terminal_summary(terminalreporter):
    if not _MODULE_SECONDS:
        return
    unit = sum(v for k, v in _MODULE_SECONDS.items() if k.startswith("tests/unit/"))
    rows = sorted(((v, k) for k, v in _MODULE_SECONDS.items() if not k.startswith("tests/unit/")), reverse=True)
    terminalreporter.write_sep("=", "minutes per module (setup + call + teardown)")
    terminalreporter.write_line(f"{unit / 60:6.1f}  tests/unit/ (all modules)")
    for seconds, module in rows:
        terminalreporter.write_line(f"{seconds / 60:6.1f}  {module}")
    terminalreporter.write_line(f"{(time.monotonic() - _STARTED) / 60:6.1f}  in all, of a {BUDGET_S / 60:.0f}-min budget")
