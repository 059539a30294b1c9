#!/usr/bin/env bash
# The Ray engine lane (scripts/engines/README.md): Ray Train in its own venv, cached outside the clone and keyed by
# versions: ${FABRICLITE_CACHE:-$HOME/.cache/fabriclite}/envs/ray-<ray>-torch<torch>-<py>.
#
#   bash scripts/engines/ray.sh            build the venv if it is not cached yet (~2 min: wheels only)
#   bash scripts/engines/ray.sh --check    exit 0 when ready, 1 when not built
#   bash scripts/engines/ray.sh --why      one line: why it is not ready (empty when it is)
#   bash scripts/engines/ray.sh --python   the venv's interpreter (the lane's tests run with it)
#
# The venv is ready once its .ready stamp exists, so an interrupted build is redone, never half-used. torch 2.13.0
# CPU comes from the local wheel folder (pip's find-links) with that exact pin, installed in the same pip call as
# ray: a looser pin, or ray's own torch requirement resolved first, would download a CUDA build.
set -euo pipefail

PYTHON=${PYTHON:-python3}
CACHE=${FABRICLITE_CACHE:-$HOME/.cache/fabriclite}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
RAY_VERSION=2.60.0
TORCH_VERSION=2.13.0
PYTAG=$("$PYTHON" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
ENV="$CACHE/envs/ray-$RAY_VERSION-torch$TORCH_VERSION-$PYTAG"

log() { echo "[engines/ray] $*" >&2; }
check() { [ -f "$ENV/.ready" ] && [ -x "$ENV/bin/python" ]; }

case ${1:-build} in
  --check) check; exit $? ;;
  --why)
    if [ ! -x "$ENV/bin/python" ]; then echo "its venv is not built ($ENV)"
    elif [ ! -f "$ENV/.ready" ]; then echo "its venv is half-built or being built ($ENV has no .ready stamp)"; fi
    exit 0 ;;
  --python) echo "$ENV/bin/python"; exit 0 ;;
  build) ;;
  *) echo "usage: $0 [--check|--why|--python]" >&2; exit 2 ;;
esac

if check; then log "ready: $ENV"; exit 0; fi
START=$(date +%s)
rm -rf "$ENV"
mkdir -p "$(dirname "$ENV")"
"$PYTHON" -m venv "$ENV"
"$ENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
"$ENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" "ray[train]==$RAY_VERSION" numpy lightning-utilities \
  pytest hypothesis pytest-timeout
"$ENV/bin/python" -c 'import torch, ray, ray.train.torch; assert torch.__version__.startswith("'"$TORCH_VERSION"'"), torch.__version__; print("ray", ray.__version__, "torch", torch.__version__)' >&2
"$ENV/bin/python" -m pip install -q --no-deps -e "$REPO"
date -u +%FT%TZ > "$ENV/.ready"
log "ready in $(( $(date +%s) - START )) s: $ENV"
