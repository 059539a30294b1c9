"""What fabriclite's own bookkeeping costs a training step, two ways:

1. The straggler timing, in isolation: the rank-side bookkeeping of one step of a DDP loop
   (``fabric.backward``'s wait bracket, one fabriclite collective's enter / finish and ``FabricOptimizer.step``'s
   ``step_done``, writing the shared-memory record the supervisor reads), with no torch work around it. The
   issue's bound is 20 us per step.
2. The job secret: a real 2-node job (``fabriclite run --num-nodes 2`` on this host, one CPU rank each, DDP on gloo;
   benchmarks/step_timing_job.py) with the job secret (node 1's supervisor and rank reach node 0's store through
   node 1's relay and node 0's authenticating relay) and without (``--insecure``: straight to the store), the two
   side by side in each round so that the machine's load falls on both alike. The goal: the secret's median step
   within 2 % of the open one's. The floor beside it: one more round of two open jobs side by side (what two
   identical jobs differ by on this machine).

    python benchmarks/step_timing.py [--steps 100000] [--repeats 5] [--job-rounds 6] [--job-steps 600]

writes benchmarks/results/step_timing.md (``--results PATH`` elsewhere).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, List, Tuple

sys.path.insert(0, os.path.dirname(__file__))
from common import REPO, Results, clean_env, table  # noqa: E402

BOUND_US = 20.0
#: the job secret's median step may be this much slower than the open job's (issue 42, part 5)
SECRET_BOUND = 1.02
JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_timing_job.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_start(secret_file: str, closed: bool, steps: int, out_dir: str, index: int) -> Tuple[List[Any], str]:
    """Start one 2-node job on this host, closed (the job secret) or open (--insecure): its two supervisors and
    the file rank 0 writes its step times to."""
    port = _free_port()
    times = os.path.join(out_dir, f"times-{index}.json")
    env = clean_env({"PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "STEPS": str(steps), "STEP_TIMES": times})
    if closed:
        env["FABRICLITE_JOB_SECRET_FILE"] = secret_file
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "1",
               "--num-nodes", "2", "--node-rank", str(node), "--main-address", "127.0.0.1", "--main-port",
               str(port), "--timeout", "120"]
        cmd += [] if closed else ["--insecure"]
        cwd = os.path.join(out_dir, f"run-{index}-{node}")  # each node its own run folder, as on two hosts
        os.makedirs(cwd)
        procs.append(subprocess.Popen(cmd + [JOB], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs, times


def job_finish(procs: List[Any], times: str, closed: bool) -> List[float]:
    """Wait for a job of :func:`job_start`: rank 0's step times (s)."""
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs) or not os.path.exists(times):
        raise RuntimeError("the step-timing job failed:\n" + "\n".join(o[-3000:] for o in outputs))
    if closed == ("--insecure" in outputs[0]):  # node 0 names --insecure's risk in one line when it runs open
        raise RuntimeError(f"the {'closed' if closed else 'open'} job ran the other way:\n{outputs[0][-2000:]}")
    with open(times) as f:
        return json.load(f)


def job_timing(args: argparse.Namespace) -> str:
    """Part 2: each round runs an open and a closed job side by side (the machine's load falls on both alike),
    and one more round two open jobs side by side: the floor, what two identical jobs differ by here."""
    from fabriclite.distributed import job_secret

    pairs: List[Tuple[float, float]] = []  # (open, secret) medians, ms
    with tempfile.TemporaryDirectory(prefix="step-timing-") as tmp:
        secret_file = os.path.join(tmp, "job.secret")
        job_secret.write_new_secret(secret_file)
        index = 0
        for round_ in range(args.job_rounds + 1):
            kinds = (False, False) if round_ == args.job_rounds else (False, True)
            started = []
            for closed in kinds:
                started.append((job_start(secret_file, closed, args.job_steps, tmp, index), closed))
                index += 1
            first, second = (statistics.median(job_finish(procs, times, closed)) * 1e3
                             for (procs, times), closed in started)
            pairs.append((first, second))
            print(f"step_timing: round {round_ + 1} ({'open, open' if kinds == (False, False) else 'open, secret'})"
                  f": medians {first:.3f} ms, {second:.3f} ms", flush=True)
    measured, control = pairs[:-1], pairs[-1]
    open_ms = statistics.median(o for o, _ in measured)
    secret_ms = statistics.median(c for _, c in measured)
    ratio = statistics.median(c / o for o, c in measured)
    floor = abs(control[1] / control[0] - 1) * 100
    ratios = [c / o for o, c in measured]
    spread = (max(ratios) - min(ratios)) / 2 * 100
    # the run resolves 2 % only if two identical jobs agree closer than that and the rounds agree with each other
    resolved = max(floor, spread) <= (SECRET_BOUND - 1) * 100
    goal = (f"- [{'x' if ratio <= SECRET_BOUND and resolved else ' '}] A training step's median with the job secret "
            f"within 2 % of the same run's without it (measured: {(ratio - 1) * 100:+.1f} %, the median over the "
            f"rounds of the secret's median step over the open one's beside it; {secret_ms:.3f} ms with, "
            f"{open_ms:.3f} ms without; floor, two open jobs side by side: {floor:.1f} % apart, and the rounds' "
            f"ratios {spread:.1f} % either side of their middle"
            + ("" if resolved else ": the noise is wider than the goal, so this run cannot tell 2 % apart") + ")")
    rows = [[f"{i + 1}", f"{o:.3f}", f"{c:.3f}", f"{(c / o - 1) * 100:+.1f} %"] for i, (o, c) in enumerate(measured)]
    rows.append(["floor", f"{control[0]:.3f}", f"{control[1]:.3f} (open)", f"{(control[1] / control[0] - 1) * 100:+.1f} %"])
    body = table(["round", "open: median step (ms)", "secret: median step (ms)", "secret vs open"], rows)
    return "\n\n".join([
        "## The job secret", goal, body,
        f"Each round starts two 2-node jobs at once, side by side on this host, one open (`--insecure`) and one "
        f"with the job secret: `fabriclite run --num-nodes 2`, one CPU rank per node (OMP_NUM_THREADS=1), DDP on "
        f"gloo, an MLP (128 -> 512 -> 512 -> 8, batch 64), AdamW; rank 0's median over {args.job_steps} timed "
        f"steps after 100 of warm-up. The floor round runs two open jobs the same way. With the secret node 1's "
        f"supervisor and rank reach node 0's store through node 1's relay and node 0's authenticating relay "
        f"(every connection proves the secret first); open, straight to the store. The gradients go over gloo's "
        f"own connections either way."])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--job-rounds", type=int, default=6,
                        help="rounds of an open and a closed 2-node job side by side (and one of two open jobs)")
    parser.add_argument("--job-steps", type=int, default=600, help="timed steps per job")
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
    body = "## The straggler timing\n\n" + table(["per step", "best (us)", "median (us)", "bound (us)", "within"],
                                                  rows)
    body += (f"\n\n{args.repeats} x {args.steps} steps, in one process, the record on a tmpfs-or-disk file mapped "
             "into memory (no system call per step).")
    if args.job_rounds > 0:
        body += "\n\n" + job_timing(args)
    print(body)
    results.write(body, path=args.results)


if __name__ == "__main__":
    main()
