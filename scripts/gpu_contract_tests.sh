#!/usr/bin/env bash
# Runs the inference contract tests against REAL SGLang (and real CUDA vLLM) on a GPU machine.
#
#   bash scripts/gpu_contract_tests.sh                 # SGLang contract tests (tests/integration/test_contract_suite.py)
#   bash scripts/gpu_contract_tests.sh -k inflight     # extra pytest arguments are passed on
#
# What it needs: an NVIDIA GPU (nvidia-smi), and SGLang in its own venv, which `bash scripts/setup.sh`
# installs at .venv/sglang when it sees a GPU (or point PIPELINE_RL_SGLANG_PYTHON at any python that
# has sglang). The tests start two shims, each with a private SGLang engine on the same GPU
# (--mem-fraction-static 0.2 each), on the tiny float32 test model.
# Knobs (environment): PIPELINE_RL_SGLANG_ARGS (extra sglang.launch_server flags; default picks kernels
# that take the tiny model: "--attention-backend triton --sampling-backend pytorch --disable-cuda-graph"),
# PIPELINE_RL_SGLANG_TRANSPORT (gloo, the default: trainer and engines share one GPU, and NCCL refuses two
# ranks on one device; use nccl with the test process on a second GPU).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! (command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1); then
  echo "gpu_contract_tests: no NVIDIA GPU here; the SGLang stand-in variant runs on CPU instead:" >&2
  echo "  .venv/bin/python -m pytest -m slow tests/integration/test_contract_suite.py -k sglang-standin" >&2
  exit 2
fi

bash scripts/setup.sh
export PIPELINE_RL_SGLANG_PYTHON="${PIPELINE_RL_SGLANG_PYTHON:-$PWD/.venv/sglang/bin/python}"
if ! "$PIPELINE_RL_SGLANG_PYTHON" -c "import sglang" 2>/dev/null; then
  echo "gpu_contract_tests: $PIPELINE_RL_SGLANG_PYTHON cannot import sglang (see scripts/setup.sh)" >&2
  exit 1
fi
echo "gpu_contract_tests: SGLang $("$PIPELINE_RL_SGLANG_PYTHON" -c 'import sglang; print(sglang.__version__)')"

export PIPELINE_RL_SGLANG=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -v -rA tests/integration/test_contract_suite.py -k "sglang and not standin" "$@"
