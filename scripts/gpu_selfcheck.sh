#!/usr/bin/env bash
# GPU self-check of the KV data path: the connector's block copies, the P/D transfer between two
# connector workers and the KV pool's worker tier, each on caches in GPU memory, in every KV
# layout vLLM's backends use; then the copy benchmark against a plain device<->host copy.
#
#   bash scripts/gpu_selfcheck.sh            # on a machine with an NVIDIA GPU and the venv built
#
# Exits non-zero on the first failing step. Writes benchmarks/results/kv_pages-cuda.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY

echo "== KV pages, P/D transfer and KV pool tier on cuda"
MOE_SERVE_KV_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
    tests/unit/test_kv_pages_layouts.py tests/unit/test_kv_connector_worker.py \
    tests/unit/test_kv_port_security.py tests/unit/test_kv_pool_tier.py

echo "== block copies against a plain device<->host copy"
"$PY" -m benchmarks.bench_kv_pages --device cuda
