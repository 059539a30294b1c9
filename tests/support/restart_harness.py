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
#: the grace the signalled jobs get, instead of the 20 s default: their ranks must save and exit within it. From the
#: signal to the job's end took up to MEASURED_AFTER_SIGNAL_S (printed by ``finish``; pytest -s shows it) on the shared
#: 2-core machine at load 11; the grace is that with a margin of 7x, for a machine loaded more (make test-stress)
MEASURED_AFTER_SIGNAL_S = 8.4
PREEMPT_GRACE_S = 7 * MEASURED_AFTER_SIGNAL_S


def start(flags: List[str], env: Dict[str, str], script: str = SCRIPT) -> subprocess.Popen:
    """`fabriclite run` of ``script`` on 2 ranks, started (its output read by ``signal_when`` / ``finish``), with a
    PREEMPT_GRACE_S grace unless ``flags`` give one."""
    grace = [] if "--preempt-grace" in flags else ["--preempt-grace", str(PREEMPT_GRACE_S)]
    return subprocess.Popen(_command([*grace, *flags], script), env=_env({"PYTHONUNBUFFERED": "1", **env}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def signal_when(proc: subprocess.Popen, marker: str, sig: int) -> str:
    """Read ``proc``'s stdout until a line holds ``marker`` (an event from the ranks), then send ``sig`` to the
    supervisor; the output read so far."""
    seen = []
    deadline = time.monotonic() + DEADLINE_S
    assert proc.stdout is not None
    for line in proc.stdout:
        seen.append(line)
        if marker in line:
            proc.send_signal(sig)
            proc.signalled_at = time.monotonic()  # type: ignore[attr-defined]
            return "".join(seen)
        assert time.monotonic() < deadline, "".join(seen)
    raise AssertionError(f"the job ended before {marker!r}: {''.join(seen)} {proc.stderr.read() if proc.stderr else ''}")


def finish(proc: subprocess.Popen) -> tuple:
    """``(exit code, rest of stdout, stderr)`` once ``proc`` ended."""
    out, err = proc.communicate(timeout=DEADLINE_S)
    signalled = getattr(proc, "signalled_at", None)
    if signalled is not None:
        print(f"ended {time.monotonic() - signalled:.1f} s after the signal (grace {PREEMPT_GRACE_S:.0f} s)")
    return proc.returncode, out, err


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
