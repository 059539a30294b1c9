"""Stop-the-world restart, 2 CPU ranks: ``fabriclite run --max-restarts 1`` against ``torchrun --max-restarts 1
--monitor-interval 0.1`` on the same job in the same run, written to benchmarks/results/fault_tolerance_restart.md.

The job: tests/support/restart_script.py (a small MLP, AdamW, a checkpoint every 10 steps, 30 steps), rank 1
SIGKILLs itself right after step 20 of round 0. The measure: the kill -> the new round's first optimizer step done
on every rank (the ranks' PHASE stamps). Three launchers, interleaved, each repeated:

- ``fabriclite run`` with its defaults (warm spares on, the first restart immediate); rank 1 kills itself once the
  spares are ready (WAIT_SPARES: in a job that runs for more than a few seconds they always are);
- ``fabriclite run --no-warm-spares`` (the immediate restart alone: a cold start of the new ranks);
- ``torchrun`` (its agent restarts the workers itself; no backoff).

Also: where the time goes (the ranks' PHASE stamps, medians), round 0's start (the launcher's start -> round 0's
first optimizer step done on every rank) with and without spares, and one waiting spare's memory (RSS, PSS).

    python benchmarks/restart_timing.py [--repeats 3]

(``benchmarks/fault_tolerance.py --part restart`` runs this too; no torchft needed.)
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import Results, clean_env  # noqa: E402

SCRIPT = ROOT / "tests" / "support" / "restart_script.py"
#: the job: a checkpoint every 10 steps, rank 1 killed after step 20 of round 0
JOB = {"STEPS": "30", "SAVE_EVERY": "10", "KILL_AT": "20:1", "PHASES": "1", "OMP_NUM_THREADS": "1",
       "PYTHONUNBUFFERED": "1"}
MODES = ("fabriclite", "fabriclite_cold", "torchrun")
LABELS = {"fabriclite": "`fabriclite run --max-restarts 1` (defaults: warm spares, immediate first restart)",
          "fabriclite_cold": "`fabriclite run --max-restarts 1 --no-warm-spares`",
          "torchrun": "`torchrun --max-restarts 1 --monitor-interval 0.1`"}
PARTS = (("imported", "the new ranks run the script, its imports done (a spare: handed the job)"),
         ("launched", "launch() returned on every rank (rendezvous, process group)"),
         ("set_up", "setup() of model, optimizer and loader done"),
         ("resumed", "load_latest() has loaded the checkpoint on every rank"),
         ("stepped", "the first optimizer step done on every rank"))


def command(mode: str) -> List[str]:
    if mode == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                "--monitor-interval", "0.1", str(SCRIPT)]
    cold = ["--no-warm-spares"] if mode == "fabriclite_cold" else []
    return [sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", "--max-restarts",
            "1", *cold, str(SCRIPT)]


def run_once(mode: str) -> Dict[str, float]:
    """One job: seconds after the kill at which each part ended (PARTS), ``round0`` (start -> round 0's first step
    on every rank), and with spares ``rss_kb`` / ``pss_kb`` of one waiting spare."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**JOB, "CKPT_DIR": os.path.join(tmp, "ckpt"), "OUT": os.path.join(tmp, "w.pt"),
               "PYTHONPATH": str(ROOT)}
        if mode == "fabriclite":
            env["WAIT_SPARES"] = "20:1"
        started = time.time()
        done = subprocess.run(command(mode), env=clean_env(env), capture_output=True, text=True, timeout=300,
                              cwd=tmp)
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed ({done.returncode}):\n{text[-3000:]}")
    killed = float(re.search(r"KILLED t=([\d.]+)", text).group(1))
    stamps: Dict[str, List[float]] = {}
    for name, _rank, t in re.findall(r"PHASE (\w+) rank=(\d+) t=([\d.]+)", text):
        stamps.setdefault(name, []).append(float(t))
    out = {name: max(t for t in stamps[name] if t > killed) - killed for name, _ in PARTS}
    round0 = [t for t in stamps["stepped"] if t < killed]
    assert len(round0) == 2 and len(stamps["stepped"]) == 4, text[-3000:]
    out["round0"] = max(round0) - started
    memory = re.search(r"SPARES READY pids=[\d,]+ t=[\d.]+ rss_kb=(\d+) pss_kb=(\d+)", text)
    if memory:
        out["rss_kb"], out["pss_kb"] = float(memory.group(1)), float(memory.group(2))
    return out


def report(runs: Dict[str, List[Dict[str, float]]], repeats: int) -> str:
    med = statistics.median

    def kill_to_step(mode: str) -> List[float]:
        return [r["stepped"] for r in runs[mode]]

    ours, cold, anchor = (med(kill_to_step(m)) for m in MODES)
    lines = [f"Stop-the-world restart, 2 CPU ranks: a rank SIGKILLed after step 20 -> the new round's first optimizer "
             f"step done on every rank (median of {repeats}, interleaved; each run's figure in brackets).", "",
             "| launcher | kill -> first step of the new round | / torchrun |", "|---|---|---|"]
    for mode in MODES:
        each = ", ".join(f"{v:.2f}" for v in kill_to_step(mode))
        lines.append(f"| {LABELS[mode]} | **{med(kill_to_step(mode)):.2f} s** ({each}) | "
                     f"{med(kill_to_step(mode)) / anchor:.2f}x |")
    lines += ["", f"fabriclite run (defaults) / torchrun: **{ours / anchor:.2f}x**; without spares {cold / anchor:.2f}x.",
              "", "Where the time goes (median seconds after the kill at which each part ended, and the part's own "
              "length):", "", "| the kill -> | " + " | ".join(LABELS[m].split(" (")[0] for m in MODES) + " |",
              "|---|" + "---|" * len(MODES)]
    for i, (name, what) in enumerate(PARTS):
        cells = []
        for mode in MODES:
            at = med([r[name] for r in runs[mode]])
            before = med([r[PARTS[i - 1][0]] for r in runs[mode]]) if i else 0.0
            cells.append(f"{at:.2f} s (+{at - before:.2f})")
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    start = {mode: [r["round0"] for r in runs[mode]] for mode in MODES}
    each = {mode: ", ".join(f"{v:.2f}" for v in start[mode]) for mode in MODES}
    with_spares, without = med(start["fabriclite"]), med(start["fabriclite_cold"])
    lines += ["", "Round 0's start (the launcher started -> round 0's first optimizer step done on every rank; spares "
              "start only after it, at nice 19):", "",
              "| | round 0's start |", "|---|---|",
              f"| with warm spares (default) | {with_spares:.2f} s ({each['fabriclite']}) |",
              f"| `--no-warm-spares` | {without:.2f} s ({each['fabriclite_cold']}) |",
              f"| with / without | **{with_spares / without:.2f}x** |",
              f"| torchrun, for reference | {med(start['torchrun']):.2f} s ({each['torchrun']}) |"]
    rss = med([r["rss_kb"] for r in runs["fabriclite"]]) / 1024
    pss = med([r["pss_kb"] for r in runs["fabriclite"]]) / 1024
    lines += ["", f"One waiting spare (torch, torch._dynamo, fabriclite imported): RSS **{rss:.0f} MiB**, PSS "
              f"**{pss:.0f} MiB** (/proc/PID/smaps_rollup, median of {repeats}); one spare per local rank, so 8 ranks "
              f"a node keep about {8 * pss / 1024:.1f} GiB (PSS) in 8 spares."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each launcher, interleaved (medians)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the results file alone")
    args = parser.parse_args(argv)
    results = Results("fault_tolerance_restart")
    runs: Dict[str, List[Dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            runs[mode].append(run_once(mode))
            print(mode, {k: round(v, 3) for k, v in runs[mode][-1].items()}, flush=True)
    body = report(runs, args.repeats)
    print(body)
    if not args.no_write:
        results.write(body, extra=[("job", "tests/support/restart_script.py, 2 CPU ranks, " + ", ".join(
            f"{k}={v}" for k, v in JOB.items() if k not in ("PHASES", "PYTHONUNBUFFERED")))])


if __name__ == "__main__":
    main()
