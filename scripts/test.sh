#!/usr/bin/env bash
# The test suite: set up (idempotent), then unit tests (fast, pure) and integration tests
# (real Ray cluster of several local nodes, real vLLM engines on CPU, real HTTP clients).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# --durations: the slowest tests in every run's output, to keep the suite near its 30-minute budget.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 "$@"
