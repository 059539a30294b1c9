"""MPI lane: a plain fabriclite script under Open MPI's ``mpirun`` (2 ranks, and 4 oversubscribed on this machine's
cores), with the main venv's torch; gloo does the collectives. Needs ``make env-mpi`` (Debian's openmpi-bin)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Dict, List

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checks  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "job.py")
NAMES = ["mpi_environment", *checks.ALL]


def mpirun(np: int, out: str) -> List[Dict[str, str]]:
    mpirun = shutil.which("mpirun")
    assert mpirun, "mpirun not found: run `make env-mpi`"
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(np), sys.executable, JOB, out]
    env = {**os.environ, "FABRICLITE_EXPECT_WORLD": str(np), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(np)]


@pytest.fixture(scope="module", params=[2, 4], ids=["np2", "np4"])
def job(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, str]]:
    return mpirun(request.param, str(tmp_path_factory.mktemp(f"mpi{request.param}")))


@pytest.mark.parametrize("name", NAMES)
def test_check(job: List[Dict[str, str]], name: str) -> None:
    for rank, res in enumerate(job):
        assert res.get(name) == "ok", f"rank {rank} of {len(job)}, {name}:\n{res.get(name, 'not run')}"
