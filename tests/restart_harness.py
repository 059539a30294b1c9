"""What the restart and preemption tests share: `fabriclite run` of tests/restart_script.py, and the final weights
of the run that never stopped (computed once per session)."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "restart_script.py")
DEADLINE_S = 240


def fabriclite_run(flags: List[str], env: Dict[str, str], script: str = SCRIPT,
                   timeout: float = DEADLINE_S) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "FABRICLITE_RESTART_BACKOFF": "0.05", **env}
    return subprocess.run([sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2",
                           *flags, script], env=full, capture_output=True, text=True, timeout=timeout)


def weights(path: str) -> List[torch.Tensor]:
    return torch.load(path, weights_only=True)


def same(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> List[torch.Tensor]:
    """The final weights of the run that never stopped."""
    tmp = tmp_path_factory.mktemp("reference")
    done = fabriclite_run([], {"CKPT_DIR": str(tmp / "ckpt"), "OUT": str(tmp / "w.pt")})
    assert done.returncode == 0, done.stderr
    return weights(str(tmp / "w.pt"))
