#!/usr/bin/env bash
# The main job: set up (idempotent), then a local multi-node cluster serving the tiny MoE model
# on the embedded default manifest. Serves until Ctrl-C. Extra arguments go to `moe-serve up`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/moe-serve up "$@"
