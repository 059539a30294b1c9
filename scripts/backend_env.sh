#!/usr/bin/env bash
# Build (or check) the environment of one backend lane, cached outside the clone and keyed by versions.
#
#   scripts/backend_env.sh horovod|xla|mpi|ft|data      build the environment if it is not cached yet
#   scripts/backend_env.sh horovod|xla|mpi|ft|data --check   exit 0 if it is ready, 1 if not (quick, no network)
#   scripts/backend_env.sh horovod|xla|mpi|ft|data --why     print why it is not ready (one line; empty when it is)
#   scripts/backend_env.sh horovod|xla|ft|data --path        print the environment's folder (whether built or not)
#
# Environments live under ${FABRICLITE_CACHE:-$HOME/.cache/fabriclite}/envs/<name>-<versions>; a venv is ready
# once its .ready stamp exists, so an interrupted build is redone, never half-used. The horovod wheel (the slow
# part, ~4 min) is cached under .../wheels/ so a rebuilt venv takes seconds. mpi is Debian's OpenMPI, used with
# the main .venv (gloo does the collectives). ft is torch 2.13.0 CPU + torchft 0.2.0 with its pinned
# requirements (scripts/ft-requirements.txt). data is torch 2.13.0 CPU + litdata 0.2.76, mosaicml-streaming 0.13.0
# and webdataset 1.0.2 with pinned requirements installed --no-deps (scripts/data-requirements.txt). Each venv also gets this checkout installed editable; the lane
# targets put the checkout first on PYTHONPATH anyway, so any clone runs its own code.
set -euo pipefail

PYTHON=${PYTHON:-python3}
CACHE=${FABRICLITE_CACHE:-$HOME/.cache/fabriclite}
REPO=$(cd "$(dirname "$0")/.." && pwd)

HVD_VERSION=0.28.1
HVD_TORCH=2.13.0
XLA_VERSION=2.9.0
XLA_TORCH=2.9.1
FT_VERSION=0.2.0
FT_TORCH=2.13.0
DATA_TORCH=2.13.0
PYTAG=$("$PYTHON" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')

usage() { echo "usage: $0 {horovod|xla|mpi|ft|data} [--check|--why|--path]" >&2; exit 2; }
[ $# -ge 1 ] || usage
LANE=$1; MODE=${2:-build}

case $LANE in
  horovod) ENV="$CACHE/envs/horovod-$HVD_VERSION-torch$HVD_TORCH-$PYTAG" ;;
  xla)     ENV="$CACHE/envs/xla-$XLA_VERSION-torch$XLA_TORCH-$PYTAG" ;;
  mpi)     ENV="" ;;
  # keyed by the pinned requirements too: a changed pin builds a new venv
  ft)      ENV="$CACHE/envs/ft-$FT_VERSION-torch$FT_TORCH-$PYTAG-$(cksum < "$REPO/scripts/ft-requirements.txt" | cut -d' ' -f1)" ;;
  data)    ENV="$CACHE/envs/data-torch$DATA_TORCH-$PYTAG-$(cksum < "$REPO/scripts/data-requirements.txt" | cut -d' ' -f1)" ;;
  *) usage ;;
esac

log() { echo "[backend_env $LANE] $*" >&2; }

check() {
  case $LANE in
    mpi) command -v mpirun >/dev/null 2>&1 && mpirun --version 2>/dev/null | grep -q 'Open MPI' ;;
    *)   [ -f "$ENV/.ready" ] && [ -x "$ENV/bin/python" ] ;;
  esac
}

why() {
  case $LANE in
    mpi)
      if ! command -v mpirun >/dev/null 2>&1; then echo "mpirun not found (Open MPI is not installed)"
      elif ! mpirun --version 2>/dev/null | grep -q 'Open MPI'; then echo "mpirun is not Open MPI's"; fi ;;
    *)
      if [ ! -x "$ENV/bin/python" ]; then echo "its venv is not built ($ENV)"
      elif [ ! -f "$ENV/.ready" ]; then echo "its venv is half-built or being built ($ENV has no .ready stamp)"; fi ;;
  esac
}

case $MODE in
  --check) check; exit $? ;;
  --why)   why; exit 0 ;;
  --path)  echo "$ENV"; exit 0 ;;
  build) ;;
  *) usage ;;
esac

if check; then log "ready: ${ENV:-$(command -v mpirun)}"; exit 0; fi
START=$(date +%s)

new_venv() {
  rm -rf "$ENV"
  mkdir -p "$(dirname "$ENV")"
  "$PYTHON" -m venv "$ENV"
  "$ENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
}

finish() {
  "$ENV/bin/python" -m pip install -q --no-deps -e "$REPO"
  date -u +%FT%TZ > "$ENV/.ready"
  log "ready in $(( $(date +%s) - START )) s: $ENV"
}

build_horovod_wheel() {
  # Prints the path of the cached wheel, building it first if needed (needs torch in $ENV, cmake and g++).
  local wheels="$CACHE/wheels/horovod-$HVD_VERSION-torch$HVD_TORCH-$PYTAG"
  local whl
  whl=$(ls "$wheels"/horovod-"$HVD_VERSION"-*.whl 2>/dev/null | head -n1 || true)
  if [ -n "$whl" ]; then echo "$whl"; return; fi
  for tool in cmake g++ make; do
    command -v $tool >/dev/null || { log "missing $tool: apt-get install -y cmake g++ make"; exit 1; }
  done
  local work; work=$(mktemp -d)
  log "building horovod $HVD_VERSION from the sdist (~4 min on 2 cores)"
  "$ENV/bin/python" -m pip download -q --no-binary :all: --no-deps -d "$work" "horovod==$HVD_VERSION"
  tar -xzf "$work"/horovod-"$HVD_VERSION".tar.gz -C "$work"
  local src="$work/horovod-$HVD_VERSION"
  # torch's headers need C++17; horovod 0.28.1 asks for 14.
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" || { log "C++17 patch did not apply"; exit 1; }
  local t0; t0=$(date +%s)
  (cd "$src" && HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
     HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j2 \
     "$ENV/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" .) >&2
  mkdir -p "$wheels"
  cp "$work"/dist/horovod-*.whl "$wheels/"
  log "horovod wheel built in $(( $(date +%s) - t0 )) s, cached in $wheels"
  rm -rf "$work"
  ls "$wheels"/horovod-"$HVD_VERSION"-*.whl | head -n1
}

case $LANE in
  horovod)
    new_venv
    # torch 2.13.0 CPU comes from the local wheel folder (pip's find-links); a looser pin would fetch CUDA.
    "$ENV/bin/python" -m pip install -q "torch==$HVD_TORCH" numpy lightning-utilities pytest hypothesis \
      pytest-timeout cloudpickle psutil pyyaml packaging cffi
    whl=$(build_horovod_wheel)
    "$ENV/bin/python" -m pip install -q --no-deps "$whl"
    "$ENV/bin/python" -c 'import horovod.torch as hvd; assert hvd.gloo_built(), "horovod built without gloo"'
    finish
    ;;
  xla)
    mkdir -p "$CACHE"; avail_kb=$(df -Pk "$CACHE" | awk 'NR==2 {print $4}')
    if [ "${avail_kb:-0}" -lt 12000000 ]; then
      log "needs ~8 GB free under $CACHE (has $(( avail_kb / 1024 )) MB)"; exit 1
    fi
    new_venv
    # torch_xla 2.9.0 pins torch 2.9.1 (a CUDA build from PyPI: ~7 GB, ~6 min).
    "$ENV/bin/python" -m pip install -q "torch==$XLA_TORCH" "torch-xla==$XLA_VERSION" numpy lightning-utilities \
      pytest hypothesis pytest-timeout
    PJRT_DEVICE=CPU "$ENV/bin/python" -c 'import torch_xla.core.xla_model as xm; print(xm.xla_device())' >&2
    finish
    ;;
  ft)
    new_venv
    # torch 2.13.0 CPU from the local wheel folder (pip's find-links), torchft and its opentelemetry
    # requirements pinned, plus what the tests use.
    "$ENV/bin/python" -m pip install -q "torch==$FT_TORCH" -r "$REPO/scripts/ft-requirements.txt" numpy \
      lightning-utilities pytest hypothesis pytest-timeout
    "$ENV/bin/python" -c 'import torchft, torchft.coordination; print("torchft", torchft.__file__)' >&2
    finish
    ;;
  data)
    new_venv
    # torch 2.13.0 CPU from the local wheel folder (pip's find-links) with its own requirements; then every other
    # package pinned and --no-deps, so that no resolver brings a CUDA torch (torchvision) or a second numpy.
    "$ENV/bin/python" -m pip install -q "torch==$DATA_TORCH"
    "$ENV/bin/python" -m pip install -q --no-deps -r "$REPO/scripts/data-requirements.txt"
    # PyPI's torchvision is a CUDA build: its C++ ops do not load next to a CPU torch, and 0.28.0 then fails at import
    # registering fakes for the missing nms ops. Streaming imports torchvision (its vision datasets), never runs it:
    # register those fakes only when the ops loaded, as torchvision does for its other ops.
    meta=$("$ENV/bin/python" -c 'import importlib.util as u; print(u.find_spec("torchvision").submodule_search_locations[0])')/_meta_registrations.py
    sed -i -E 's/^@torch\.library\.register_fake\(("torchvision::q?nms")\)$/@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda fn: fn))/' "$meta"
    grep -q 'if torchvision.extension._has_ops() else' "$meta" || { log "torchvision nms patch did not apply"; exit 1; }
    "$ENV/bin/python" -c 'import torch, litdata, streaming, webdataset; assert "+cpu" in torch.__version__, torch.__version__; print("litdata", litdata.__version__, "streaming", streaming.__version__, "webdataset", webdataset.__version__)' >&2
    finish
    ;;
  mpi)
    export DEBIAN_FRONTEND=noninteractive
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -q >&2
    $SUDO apt-get install -y -q openmpi-bin libopenmpi-dev >&2
    mpirun --version | head -n1 >&2
    log "ready in $(( $(date +%s) - START )) s"
    ;;
esac
