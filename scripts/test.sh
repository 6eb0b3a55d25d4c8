#!/usr/bin/env bash
# The test suite: set up (idempotent), then unit tests (fast, pure) and integration tests
# (real Ray cluster of several local nodes, real vLLM engines on CPU, real HTTP clients).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# --durations: the slowest tests in every run's output (tests/conftest.py adds minutes per module);
# `--extended` also runs the extended tier (docs/testing.md).
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 "$@"
