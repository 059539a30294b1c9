#!/usr/bin/env bash
# The SLURM engine lane's environment: Debian's slurm-wlm + munge, installed with apt-get (needs root). The
# lane's tests (tests/integration/engines/lane_slurm) start a 3-node cluster on this machine themselves
# (tests/support/slurm_cluster.py: a munged, a slurmctld and three slurmd -N n1/n2/n3, config in a temp dir)
# and stop it after; they run with the main .venv. Interface: scripts/engines/README.md.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
TOOLS="slurmctld slurmd munged srun sbatch scontrol scancel squeue"

missing() {
  local t
  for t in $TOOLS; do command -v "$t" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin:/sbin" command -v "$t" >/dev/null 2>&1 || echo "$t"; done
}

why() {
  if [ "$(id -u)" != 0 ]; then
    echo "needs root (apt-get install slurm-wlm munge, and slurmctld/slurmd run as root); this is uid $(id -u)"
    return
  fi
  if ! command -v apt-get >/dev/null 2>&1 && [ -n "$(missing)" ]; then
    echo "needs apt-get (Debian's slurm-wlm and munge) or SLURM's tools on PATH; missing: $(missing | tr '\n' ' ')"
    return
  fi
  local m
  m="$(missing | tr '\n' ' ')"
  [ -n "$m" ] && echo "slurm-wlm / munge not installed (missing: ${m% })"
  return 0
}

case "${1:-}" in
  --check)
    [ "$(id -u)" != 0 ] && exit 3
    [ -z "$(missing)" ] && exit 0
    command -v apt-get >/dev/null 2>&1 || exit 3
    exit 1 ;;
  --why) why ;;
  --python) echo "$ROOT/.venv/bin/python" ;;
  "")
    if [ "$(id -u)" != 0 ]; then echo "slurm engine lane: $(why)" >&2; exit 3; fi
    if [ -z "$(missing)" ]; then echo "slurm engine lane: slurm-wlm and munge already installed ($(slurmd -V 2>/dev/null || /usr/sbin/slurmd -V))"; exit 0; fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null || exit 1
    echo "slurm engine lane: installed $(/usr/sbin/slurmd -V) and munge"
    ;;
  *) echo "usage: $0 [--check|--why|--python]" >&2; exit 2 ;;
esac
