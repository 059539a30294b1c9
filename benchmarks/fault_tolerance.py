"""Fault tolerance costs, on 2 CPU ranks under `fabriclite run`:

- restart: the wall time from a rank SIGKILLing itself mid-epoch (tests/support/restart_script.py, --max-restarts 1, the
  default 1 s backoff) to the new round's ranks having loaded the latest checkpoint (training resumed);
- check_preempted(): the median time of one call (one all_reduce of one number), against a barrier;
- resume_state(): the median time of its state_dict() per save (gathering every rank's RNG states).

    python benchmarks/fault_tolerance.py [--repeats 3]

writes benchmarks/results/fault_tolerance.md (``--results PATH`` elsewhere).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from common import Results  # noqa: E402
COSTS = r"""
import statistics, time
from fabriclite import Fabric
fabric = Fabric(accelerator="cpu")
fabric.launch()
state = fabric.resume_state()

def timed(fn, n):
    for _ in range(5):
        fn()
    out = []
    for _ in range(n):
        fabric.barrier()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e6

check = timed(fabric.check_preempted, 300)
barrier = timed(fabric.barrier, 300)
resume = timed(state.state_dict, 100)
if fabric.global_rank == 0:
    print(f"COSTS check_preempted={check:.0f}us barrier={barrier:.0f}us resume_state={resume:.0f}us", flush=True)
"""


def run(args, env=None):
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2",
                           *args], env=full, capture_output=True, text=True, timeout=600, cwd=ROOT)


def restart_time() -> float:
    with tempfile.TemporaryDirectory() as tmp:
        done = run(["--max-restarts", "1", os.path.join(ROOT, "tests", "support", "restart_script.py")],
                   {"CKPT_DIR": os.path.join(tmp, "ckpt"), "OUT": os.path.join(tmp, "w.pt"), "KILL_AT": "13:1"})
        assert done.returncode == 0, done.stderr
        killed = float(re.search(r"KILLED t=([\d.]+)", done.stdout).group(1))
        resumed = float(re.search(r"ROUND 1 resumed .* t=([\d.]+)", done.stdout).group(1))
        return resumed - killed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", default=None, help="the results file (benchmarks/results/fault_tolerance.md)")
    args = parser.parse_args()
    results = Results("fault_tolerance")
    times = sorted(restart_time() for _ in range(args.repeats))
    lines = [f"failure to training resumed (2 ranks, 1 s backoff): median {times[len(times) // 2]:.1f} s, "
             f"all {[round(t, 1) for t in times]}"]
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "costs.py")
        with open(script, "w") as f:
            f.write(COSTS)
        done = run([script])
        lines.append(next(line for line in done.stdout.splitlines() if line.startswith("COSTS")))
    print("\n".join(lines))
    results.write("\n\n".join(lines))


if __name__ == "__main__":
    main()
