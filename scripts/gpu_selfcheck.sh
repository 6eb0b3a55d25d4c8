#!/usr/bin/env bash
# GPU self-check of the KV data path: the connector's block copies, the P/D transfer between two
# connector workers and the KV pool's worker tier, each on caches in GPU memory, in every KV
# layout vLLM's backends use; then the copy benchmark against a plain device<->host copy; then
# P/D between two real vLLM engines through our connector (TP 2 on a machine with two GPUs, one
# KV endpoint per rank), whose greedy output must equal one plain engine's.
#
#   bash scripts/gpu_selfcheck.sh            # on a machine with an NVIDIA GPU (driver >= 580)
#   PYTHON=/path/to/python bash scripts/gpu_selfcheck.sh   # with a GPU stack installed already
#
# From a bare machine it installs what it needs first: Mooncake's libraries (apt), the `gpu`
# stack in .venv-gpu (upstream vLLM with its CUDA torch, Mooncake's CUDA 13 wheel) and the tiny
# checkpoints (built locally). Exits non-zero on the first failing step. Writes
# benchmarks/results/kv_pages-cuda.json.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ] && [ ! -x .venv-gpu/bin/python ]; then
  echo "== installing the gpu stack into .venv-gpu (a few minutes)"
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      libibverbs1 ibverbs-providers librdmacm1 libnuma1 libcurl4 >/dev/null
  python3 -m venv .venv-gpu
  .venv-gpu/bin/pip install -q -e ".[gpu,dev]"
fi
PY=${PYTHON:-.venv-gpu/bin/python}
"$PY" -m cluster.checkpoints --all --quiet

echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$PY" - <<'PY'
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY

echo "== KV pages, P/D transfer and KV pool tier on cuda"
MOE_SERVE_KV_TEST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
    tests/unit/kv_transfer/test_kv_pages_layouts.py tests/unit/kv_transfer/test_kv_connector_worker.py \
    tests/unit/kv_transfer/test_kv_port_security.py tests/unit/kv_transfer/test_kv_pool_tier.py tests/unit/kv_transfer/test_kv_tensor_parallel.py \
    tests/unit/kv_transfer/test_kv_mooncake_staged.py

echo "== block copies against a plain device<->host copy"
"$PY" -m benchmarks.bench_kv_pages --device cuda

echo "== P/D through the connector between two vLLM engines on CUDA, against one plain engine"
OUT=$(mktemp -d)
MODEL=$("$PY" -c "from cluster.checkpoints import resolve_model_path as r; print(r('builtin://tiny-qwen3-moe'))")
GPUS=$(nvidia-smi --list-gpus | wc -l)
TP=$(( GPUS >= 2 ? 2 : 1 ))
"$PY" tests/reference_engine.py "$MODEL" "$OUT/plain.json" --max-model-len 2048 --dtype float32 --prompts long,short
"$PY" tests/tp_disagg_engines.py "$MODEL" "$OUT/pd.json" --tp "$TP" --max-model-len 2048 --dtype float32
"$PY" - "$OUT/plain.json" "$OUT/pd.json" <<'PY'
import json, sys
plain, pd = (json.load(open(path)) for path in sys.argv[1:3])
kv = pd["decode_kv"]
print(f"{'prompt':8} {'identical':>9}  (P/D with TP {pd['tp']}, one KV endpoint per rank)")
for name, tokens in pd["outputs"].items():
    print(f"{name:8} {str(tokens == plain[name]['token_ids']):>9}")
rate = kv["bytes_loaded_total"] / max(kv["pull_seconds_total"], 1e-9) / 1e9
print(f"pulled {kv['bytes_loaded_total']} B in {kv['pulls_succeeded_total']} pulls, {rate:.2f} GB/s over the pulls")
assert all(tokens == plain[name]["token_ids"] for name, tokens in pd["outputs"].items()), "P/D output differs"
assert kv["pulls_failed_total"] == 0 and pd["prefill_kv"]["leases_outstanding"] == 0
PY
