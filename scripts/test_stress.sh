#!/usr/bin/env bash
# `make test-stress`: the core suite (or the test paths given after the interpreter) three times in a row while
# two busy processes keep both CPUs loaded; no retries, no reruns: every run must pass. Every run is made, even after
# one failed; each prints its counts and time, and the last line gives the totals over the runs (exit 1 unless every
# run passed). Each run's pytest output is kept in $STRESS_LOG_DIR (default build/test-stress/run-<n>.log).
# The fault storm soaks there (STRESS_SOAK=1; STRESS_SOAK=0 keeps it at its make test length).
#   scripts/test_stress.sh PYTHON [pytest arguments...]     (default: tests)
set -u
PY=$1; shift
[ $# -gt 0 ] || set -- tests
RUNS=${STRESS_RUNS:-3}
# the fault storm (tests/integration/checkpoint/test_fault_storm.py) soaks: 5 minutes of faults, a longer job
export STRESS_SOAK=${STRESS_SOAK:-1}
BUSY=${STRESS_BUSY:-2}
LOGS=${STRESS_LOG_DIR:-build/test-stress}
mkdir -p "$LOGS"
busy_pids=()
stop_busy() { for pid in "${busy_pids[@]}"; do kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done; }
trap stop_busy EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$BUSY"); do
  "$PY" -c "while True: pass" &
  busy_pids+=($!)
done

# pytest's count line of a log ("2 failed, 604 passed, 9 skipped, 88 warnings in 63.38s"): "passed failed errors
# skipped xfailed xpassed" as numbers (0 for those not there), or nothing when the log has no count line
counts_of() {
  local line
  line=$(grep -E '^[0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)|^no tests ran' "$1" | tail -1)
  [ -n "$line" ] || return 0
  for what in passed failed 'errors?' skipped xfailed xpassed; do
    n=$(printf '%s\n' "$line" | grep -oE "[0-9]+ $what\b" | grep -oE '^[0-9]+')
    printf '%s ' "${n:-0}"
  done
  echo
}

echo "== test-stress: $RUNS runs of pytest $* with $BUSY busy processes (pids ${busy_pids[*]}) on $(nproc) CPUs"
start=$(date +%s); times=""; passed_runs=0; failed_runs=""
total=(0 0 0 0 0 0)
for run in $(seq "$RUNS"); do
  t0=$(date +%s); log="$LOGS/run-$run.log"
  "$PY" -u -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  took=$(( $(date +%s) - t0 )); times="$times ${took}s"
  read -r -a c <<< "$(counts_of "$log")"
  if [ ${#c[@]} -eq 6 ]; then
    for i in 0 1 2 3 4 5; do total[$i]=$(( total[i] + c[i] )); done
    what="${c[0]} passed, ${c[1]} failed, ${c[2]} errors, ${c[3]} skipped"
    [ "${c[4]}${c[5]}" = 00 ] || what="$what, ${c[4]} xfailed, ${c[5]} xpassed"
  else
    what="no count line (pytest ended early)"
  fi
  if [ "$rc" -eq 0 ]; then verdict=passed; passed_runs=$((passed_runs + 1))
  else verdict="FAILED (pytest exit $rc)"; failed_runs="$failed_runs $run"; fi
  echo "== test-stress: run $run of $RUNS $verdict in $took s: $what; load average $(cut -d' ' -f1-3 /proc/loadavg) (log: $log)"
done
summary="${total[0]} passed, ${total[1]} failed, ${total[2]} errors, ${total[3]} skipped"
[ "${total[4]}${total[5]}" = 00 ] || summary="$summary, ${total[4]} xfailed, ${total[5]} xpassed"
echo "== test-stress: total over $RUNS runs: $summary; $passed_runs of $RUNS runs passed in $(( $(date +%s) - start )) s (each:$times)"
if [ -n "$failed_runs" ]; then
  echo "== test-stress: FAILED: run(s)$failed_runs failed (no retries)"
  exit 1
fi
