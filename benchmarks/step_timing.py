"""What the straggler timing costs per optimizer step, measured in isolation: the rank-side bookkeeping of one
step of a DDP loop (``fabric.backward``'s wait bracket, one fabriclite collective's enter / finish and
``FabricOptimizer.step``'s ``step_done``, writing the shared-memory record the supervisor reads), with no torch work
around it. The issue's bound is 20 us per step.

    python benchmarks/step_timing.py [--steps 100000] [--repeats 5]

writes benchmarks/results/step_timing.md (``--results PATH`` elsewhere).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, table  # noqa: E402

BOUND_US = 20.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", default=None, help="the results file (benchmarks/results/step_timing.md)")
    args = parser.parse_args()
    results = Results("step_timing")

    from fabriclite.supervision.rank import progress as rank_progress

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "progress")
        rank_progress.create(path)
        record = rank_progress.RankProgress(path)

        def one_step_bare() -> None:  # what a step pays without any collective of fabriclite's
            record.wait_started()  # fabric.backward
            record.wait_ended()
            record.step_done()  # FabricOptimizer.step

        def one_step_with_collective() -> None:
            record.wait_started()
            record.wait_ended()
            record.collective_entered("all_reduce", 1)  # e.g. a logged metric's all_reduce
            record.collective_finished("all_reduce", 1)
            record.step_done()

        for name, fn in (("backward bracket + step_done", one_step_bare),
                         ("+ one fabriclite collective", one_step_with_collective)):
            per_step = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                per_step.append((time.perf_counter() - start) / args.steps * 1e6)
            rows.append([name, f"{min(per_step):.2f}", f"{statistics.median(per_step):.2f}", f"{BOUND_US:g}",
                         "yes" if statistics.median(per_step) <= BOUND_US else "NO"])
    body = table(["per step", "best (us)", "median (us)", "bound (us)", "within"], rows)
    body += (f"\n\n{args.repeats} x {args.steps} steps, in one process, the record on a tmpfs-or-disk file mapped "
             "into memory (no system call per step).")
    print(body)
    results.write(body, path=args.results)


if __name__ == "__main__":
    main()
