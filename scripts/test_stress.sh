#!/usr/bin/env bash
# `make test-stress`: the core suite (or the test paths given after the interpreter) three times in a row while
# two busy processes keep both CPUs loaded; no retries, no reruns: every run must pass. Prints each run's time.
# The fault storm soaks there (STRESS_SOAK=1; STRESS_SOAK=0 keeps it at its make test length).
#   scripts/test_stress.sh PYTHON [pytest arguments...]     (default: tests)
set -u
PY=$1; shift
[ $# -gt 0 ] || set -- tests
RUNS=${STRESS_RUNS:-3}
# the fault storm (tests/integration/checkpoint/test_fault_storm.py) soaks: 5 minutes of faults, a longer job
export STRESS_SOAK=${STRESS_SOAK:-1}
BUSY=${STRESS_BUSY:-2}
busy_pids=()
stop_busy() { for pid in "${busy_pids[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done; }
trap stop_busy EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$BUSY"); do
  "$PY" -c "while True: pass" &
  busy_pids+=($!)
done
echo "== test-stress: $RUNS runs of pytest $* with $BUSY busy processes (pids ${busy_pids[*]}) on $(nproc) CPUs"
start=$(date +%s); times=""
for run in $(seq "$RUNS"); do
  t0=$(date +%s)
  if ! "$PY" -m pytest -q -p no:cacheprovider "$@"; then
    echo "== test-stress: run $run of $RUNS FAILED after $(( $(date +%s) - t0 )) s"
    exit 1
  fi
  times="$times $(( $(date +%s) - t0 ))s"
done
echo "== test-stress: $RUNS of $RUNS runs passed in $(( $(date +%s) - start )) s (each:$times; load average $(cut -d' ' -f1-3 /proc/loadavg))"
