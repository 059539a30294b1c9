#!/usr/bin/env bash
# The GPU check in one command: `make gpu-check PYTHON=python3` (this script, run from the repository root).
#
# Uses the interpreter given as $1 as it is: it must already hold a CUDA build of torch, Lightning and pytest;
# nothing is installed and no .venv is made; fabriclite comes from this checkout (PYTHONPATH). Where no GPU is
# visible it prints one line and exits 0. Otherwise it runs, in order (each step's failure fails the check, after
# the others have run):
#   1. the CUDA tests (tests/integration/accelerators/test_cuda.py, and the cuda cases of the other test files);
#   2. NCCL collectives through benchmarks/collectives.py --backend nccl, one rank per GPU: a one-rank smoke run
#      on one GPU (benchmarks/results/collectives_nccl_smoke.md), the full table with two or more
#      (benchmarks/results/collectives_nccl.md);
#   3. benchmarks/gpu_training.py on one GPU (2 rounds): raw loop, fabriclite, Lightning Fabric (benchmarks/results/gpu_training.md).
set -u
PY=${1:-python3}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null)
if [ -z "$gpus" ]; then
  if [ -e /dev/nvidia0 ] || nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: FAILED: a GPU is here, but '$PY' cannot import torch (give PYTHON=<python with a CUDA torch>)"
    exit 1
  fi
  gpus=0
fi
if [ "$gpus" -eq 0 ]; then
  echo "gpu-check: skipped: no CUDA GPU visible to $PY (nothing run)"
  exit 0
fi

failed=""
step() {  # step NAME COMMAND...: run it, time it, remember a failure
  local name=$1; shift
  local t0; t0=$(date +%s)
  echo "== gpu-check: $name: $*"
  if "$@"; then echo "== gpu-check: $name passed ($(( $(date +%s) - t0 )) s)"
  else echo "== gpu-check: $name FAILED ($(( $(date +%s) - t0 )) s)"; failed="$failed $name"; fi
}

echo "== gpu-check: $gpus GPU(s); $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "-", torch.cuda.get_device_name(0))')"
step cuda-tests "$PY" -m pytest -q -p no:cacheprovider tests/integration/accelerators/test_cuda.py
step cuda-cases "$PY" -m pytest -q -p no:cacheprovider -k "cuda or gpu" tests/unit/training/test_training_single.py \
  tests/integration/training/test_utilities.py tests/unit/fabric/test_connector.py
if [ "$gpus" -ge 2 ]; then
  step nccl-collectives "$PY" benchmarks/collectives.py --backend nccl --ranks "$gpus"
else
  step nccl-collectives-smoke "$PY" benchmarks/collectives.py --backend nccl --ranks 1 --runs 1 --calls 20 \
    --big-calls 4 --budget 1 --results benchmarks/results/collectives_nccl_smoke.md
fi
# 2 rounds (each measurement is a fresh process, ~14 s on an H200): the whole check then takes about 7 minutes, which
# fits a 15-minute device lease with its start; GPU_TRAINING_ROUNDS=3 for the benchmark's own default
step gpu-training "$PY" benchmarks/gpu_training.py --rounds "${GPU_TRAINING_ROUNDS:-2}"
if [ -n "$failed" ]; then echo "== gpu-check FAILED:$failed"; exit 1; fi
echo "== gpu-check passed; tables in benchmarks/results/"
