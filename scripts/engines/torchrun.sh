#!/usr/bin/env bash
# The torchrun engine lane (scripts/engines/README.md): torch's elastic agent (torchrun, c10d rendezvous), which
# comes with torch in the main .venv: nothing to build.
#
#   bash scripts/engines/torchrun.sh            nothing to install: says whether torchrun works (exit 1 if not)
#   bash scripts/engines/torchrun.sh --check    exit 0 when torchrun runs from the main .venv, 1 when it does not
#   bash scripts/engines/torchrun.sh --why      one line: why it is not ready (empty when it is)
#   bash scripts/engines/torchrun.sh --python   the main .venv's interpreter (the lane's tests run with it)
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY="$REPO/.venv/bin/python"

# torchrun is torch.distributed.run's console script; the lane starts it as `python -m torch.distributed.run` (the
# same entry point) so that it runs with this interpreter wherever the venv's bin/ is on PATH or not.
check() { [ -x "$PY" ] && "$PY" -m torch.distributed.run --help >/dev/null 2>&1; }

case ${1:-build} in
  --check) check; exit $? ;;
  --why)
    if [ ! -x "$PY" ]; then echo "the main .venv is missing ($PY): run 'make venv'"
    elif ! check; then echo "torchrun does not start: '$PY -m torch.distributed.run --help' fails"; fi
    exit 0 ;;
  --python) echo "$PY"; exit 0 ;;
  build)
    if check; then echo "[engines/torchrun] ready: torchrun of $("$PY" -c 'import torch; print("torch", torch.__version__)')" >&2; exit 0; fi
    echo "[engines/torchrun] $("$0" --why)" >&2; exit 1 ;;
  *) echo "usage: $0 [--check|--why|--python]" >&2; exit 2 ;;
esac
