"""The linter and the type checker, as the README's test command runs them (issue 30): ruff on
the whole tree (pyflakes' errors: unused and undefined names, redefinitions), mypy --strict on
the modules where components meet (`[tool.mypy] files` in pyproject.toml). A contributor runs
the same locally: `.venv/bin/ruff check .` and `.venv/bin/mypy`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    try:
        __import__(module)
    except ImportError:
        pytest.fail(f"{module} is not installed: scripts/setup.sh installs it (pyproject.toml's dev extra)")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def test_ruff_finds_nothing():
    result = _run("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_the_seams_type_check_strictly():
    result = _run("mypy", "--no-incremental")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "Success" in result.stdout
