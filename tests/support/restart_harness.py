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


def start(flags: List[str], env: Dict[str, str], script: str = SCRIPT) -> subprocess.Popen:
    """`fabriclite run` of ``script`` on 2 ranks, started (its output read by ``signal_when`` / ``finish``)."""
    return subprocess.Popen(_command(flags, script), env=_env({"PYTHONUNBUFFERED": "1", **env}),
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
            return "".join(seen)
        assert time.monotonic() < deadline, "".join(seen)
    raise AssertionError(f"the job ended before {marker!r}: {''.join(seen)} {proc.stderr.read() if proc.stderr else ''}")


def finish(proc: subprocess.Popen) -> tuple:
    """``(exit code, rest of stdout, stderr)`` once ``proc`` ended."""
    out, err = proc.communicate(timeout=DEADLINE_S)
    return proc.returncode, out, err


def _command(flags: List[str], script: str) -> List[str]:
    return [sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", *flags, script]


def _env(env: Dict[str, str]) -> Dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "FABRICLITE_RESTART_BACKOFF": "0.05", **env}


def fabriclite_run(flags: List[str], env: Dict[str, str], script: str = SCRIPT,
                   timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    return subprocess.run(_command(flags, script), env=_env(env), capture_output=True, text=True, timeout=timeout)


def run_many(jobs: Dict[str, Tuple[List[str], Dict[str, str]]]) -> Dict[str, subprocess.CompletedProcess]:
    """``fabriclite run`` of every ``name: (flags, env)`` at once (they overlap their start-ups); each result."""
    procs = {name: subprocess.Popen(_command(flags, SCRIPT), env=_env(env), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, (flags, env) in jobs.items()}
    results = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            for other in procs.values():
                other.kill()
            raise
        results[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return results


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
