"""Bit-exact resume at 3 or more ranks under `fabriclite run --max-restarts 1` (tests/support/exact_script.py): a rank
SIGKILLed mid-run, the restarted round resumes from the latest checkpoint, and the final weights equal the
uninterrupted run's bit for bit, with plain `ddp` on 3, 4 and 6 ranks and `fsdp` on 4.

One job per case: its round 0 first runs the uninterrupted run (from scratch, saving into its own folder, no kill)
and writes its final weights, then starts the run that is killed in the same processes (a new model, DDP, optimizer
and loader); the restarted round, fresh processes, resumes that run from its checkpoint. (Each case was two jobs,
reference and killed: the reference jobs' 17 rank start-ups are saved.)

Each `ddp` case has its negative control, which must differ: in the restarted round, after the run, the same resume
again from the same checkpoint in the same processes with the layout fix switched off (FABRICLITE_DDP_BUCKET_LAYOUT=0).
The model registers its parameters in an order unlike their use, so DDP's rebuilt buckets (gradient-ready order) are
not its first step's one bucket (parameter order) and the sums of 3+ numbers land in other orders. The 4-rank case
resumes from the checkpoint written after step 1, while DDP's bucket rebuild was still pending (recording runs it).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "support", "exact_script.py")
#: every job of the module at once, at most RANK_BUDGET ranks running: measured 150 s at load 20-25 on the shared 2-core
#: machine; each job's deadline and the module's bound are 4x that. (Kept when its 8 jobs became 4, one per case: 175 s
#: with 8 jobs at load 8-13, 94-108 s with 4 at load 12-16.)
MEASURED_S = 150
DEADLINE_S = 4 * MEASURED_S
RANK_BUDGET = 12
pytestmark = [pytest.mark.slow, pytest.mark.timeout(4 * MEASURED_S + 60)]

#: name -> (ranks, strategy, environment of the killed run); the killed rank and step vary
CASES: Dict[str, Tuple[int, str, Dict[str, str]]] = {
    "ddp3": (3, "ddp", {"KILL_AT": "5:1", "CONTROL": "1"}),
    "ddp4": (4, "ddp", {"KILL_AT": "2:1", "CONTROL": "1"}),  # resumes from step 1: recorded by a pending rebuild
    "ddp6": (6, "ddp", {"KILL_AT": "5:2", "CONTROL": "1"}),
    "fsdp4": (4, "fsdp", {"KILL_AT": "5:3"}),
}


def _command(ranks: int) -> List[str]:
    return [sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", str(ranks),
            "--max-restarts", "1", SCRIPT]


def _run_all(jobs: Dict[str, Tuple[int, Dict[str, str]]]) -> Dict[str, Tuple[subprocess.CompletedProcess, float]]:
    """Every ``name: (ranks, env)`` job, started while the ranks running stay within RANK_BUDGET; each result and
    its seconds. One past DEADLINE_S kills them all and raises."""
    waiting, running, done = list(jobs.items()), {}, {}
    while waiting or running:
        while waiting and (not running or sum(jobs[n][0] for n in running) + waiting[0][1][0] <= RANK_BUDGET):
            name, (ranks, env) = waiting.pop(0)
            proc = subprocess.Popen(_command(ranks), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1", "FABRICLITE_RESTART_BACKOFF": "0.05",
                                         **env})
            running[name] = (proc, time.monotonic())
        for name, (proc, started) in list(running.items()):
            if proc.poll() is not None:
                out, err = proc.communicate()
                done[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
                              time.monotonic() - started)
                del running[name]
            elif time.monotonic() - started > DEADLINE_S:
                for other, _ in running.values():
                    other.kill()
                raise subprocess.TimeoutExpired(proc.args, DEADLINE_S)
        time.sleep(0.2)
    return done


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[str, List[torch.Tensor]]]:
    """case -> {"reference", "resumed", and for ddp "control"}: the final weights of every case's job (its
    reference pass, its resumed run, its control)."""
    jobs, dirs = {}, {}
    for case, (ranks, strategy, env) in CASES.items():
        tmp = dirs[case] = tmp_path_factory.mktemp(case)
        jobs[case] = (ranks, {"STRATEGY": strategy, "CKPT_DIR": str(tmp / "ckpt"), "OUT": str(tmp / "w.pt"),
                              "REFERENCE_CKPT_DIR": str(tmp / "reference-ckpt"),
                              "REFERENCE_OUT": str(tmp / "reference.pt"), **env})
    started = time.monotonic()
    done = _run_all(jobs)
    print(f"all jobs: {time.monotonic() - started:.0f} s; "
          + ", ".join(f"{name} {seconds:.0f} s" for name, (_, seconds) in done.items()))
    out: Dict[str, Dict[str, List[torch.Tensor]]] = {}
    for case, (_, _, env) in CASES.items():
        result = done[case][0]
        assert result.returncode == 0, f"{case}: {result.stdout}\n{result.stderr}"
        # the reference ran from scratch, once, before the killed run; then a real restart, from a file
        assert result.stdout.count("REFERENCE 0 resumed from None at step 0") == 1, result.stdout
        assert "ROUND 0 resumed from None at step 0" in result.stdout, result.stdout
        assert "ROUND 1 resumed from step-" in result.stdout, result.stdout
        path = dirs[case] / "w.pt"
        out[case] = {"reference": torch.load(dirs[case] / "reference.pt", weights_only=True),
                     "resumed": torch.load(path, weights_only=True)}
        if env.get("CONTROL") == "1":
            out[case]["control"] = torch.load(str(path) + ".control", weights_only=True)
    return out


def _same(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("case", ["ddp3", "ddp4", "ddp6", "fsdp4"])
def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights_bit_for_bit(results, case):
    assert _same(results[case]["resumed"], results[case]["reference"])


@pytest.mark.parametrize("case", ["ddp3", "ddp4", "ddp6"])
def test_negative_control_without_the_recorded_bucket_layout_the_last_bits_differ(results, case):
    control, reference = results[case]["control"], results[case]["reference"]
    assert not _same(control, reference), "the control matched: the test could not have failed"
    assert all(torch.allclose(x, y, rtol=0, atol=1e-5) for x, y in zip(control, reference))  # only the last bits
