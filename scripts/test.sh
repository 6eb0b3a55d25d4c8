#!/usr/bin/env bash
# The test suite: set up (idempotent), then unit tests (fast, pure) and integration tests
# (real Ray cluster of several local nodes, real vLLM engines on CPU, real HTTP clients).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
