"""What the restart and preemption tests share: `fabriclite run` of tests/support/restart_script.py, and the final weights
of the run that never stopped (computed once per session)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "restart_script.py")
DEADLINE_S = 240


def _command(flags: List[str], script: str) -> List[str]:
    return [sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", *flags, script]


def _env(env: Dict[str, str]) -> Dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "FABRICLITE_RESTART_BACKOFF": "0.05", **env}


def fabriclite_run(flags: List[str], env: Dict[str, str], script: str = SCRIPT,
                   timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    return subprocess.run(_command(flags, script), env=_env(env), capture_output=True, text=True, timeout=timeout)


#: jobs of run_many running at once: each is a supervisor and 2 ranks, so 3 jobs are 6 ranks on the 2 cores; more
#: (the restart module has 9) only stretch every job's start-up and each job's deadline with it
MAX_JOBS = 3


def run_many(jobs: Dict[str, Tuple[List[str], Dict[str, str]]]) -> Dict[str, subprocess.CompletedProcess]:
    """``fabriclite run`` of every ``name: (flags, env)``, at most MAX_JOBS at once (they overlap their start-ups;
    the next starts as soon as one ends); each result. Each job has DEADLINE_S from its own start; one past it
    kills them all and raises. (The jobs print little: their pipes never fill before they end.)"""
    waiting = list(jobs.items())
    running: Dict[str, Tuple[subprocess.Popen, float]] = {}
    results: Dict[str, subprocess.CompletedProcess] = {}
    while waiting or running:
        while waiting and len(running) < MAX_JOBS:
            name, (flags, env) = waiting.pop(0)
            running[name] = (subprocess.Popen(_command(flags, SCRIPT), env=_env(env), stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True), time.monotonic())
        for name, (proc, started) in list(running.items()):
            if proc.poll() is not None:  # ended: its output is all in the pipes
                out, err = proc.communicate()
                results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
                del running[name]
            elif time.monotonic() - started > DEADLINE_S:
                for other, _ in running.values():
                    other.kill()
                raise subprocess.TimeoutExpired(proc.args, DEADLINE_S)
        time.sleep(0.2)
    return {name: results[name] for name in jobs}


#: the reference weights, once per session (a test module may compute them along with its own jobs)
REFERENCE: List[List[torch.Tensor]] = []


def reference_job(tmp: Path) -> Tuple[List[str], Dict[str, str]]:
    return [], {"CKPT_DIR": str(tmp / "ckpt"), "OUT": str(tmp / "w.pt")}


def keep_reference(done: subprocess.CompletedProcess, tmp: Path) -> None:
    assert done.returncode == 0, done.stderr
    REFERENCE.append(weights(str(tmp / "w.pt")))


def weights(path: str) -> List[torch.Tensor]:
    return torch.load(path, weights_only=True)


def same(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> List[torch.Tensor]:
    """The final weights of the run that never stopped."""
    if not REFERENCE:
        tmp = tmp_path_factory.mktemp("reference")
        keep_reference(fabriclite_run(*reference_job(tmp)), tmp)
    return REFERENCE[0]
