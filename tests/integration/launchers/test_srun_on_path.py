"""A machine with SLURM's tools installed (every node of a cluster; CI once the SLURM engine lane has run):
`fabriclite run` is a launcher the user chose, so Lightning's hint that ``srun`` exists but is not used is not
given; a plain script that starts its own ranks still gets it, as in Lightning. Needs a real ``srun`` on PATH:
skipped (one line) where SLURM is not installed (scripts/engines/slurm.sh installs it)."""
from __future__ import annotations

import shutil
import sys

import pytest

from helpers import python, run, write_script

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("srun") is None,
                                 reason="srun is not installed here (SLURM's tools: scripts/engines/slurm.sh)")]

HINT = "The `srun` command is available on your system but is not used"
SCRIPT = """
    from fabriclite import Fabric
    fabric = Fabric(accelerator="cpu")
    fabric.launch()
    print(f"RANK {fabric.global_rank} of {fabric.world_size}", flush=True)
"""


def test_fabriclite_run_gives_no_srun_hint_where_srun_is_installed(tmp_path):
    script = write_script(tmp_path, SCRIPT)
    done = run([sys.executable, "-m", "fabriclite", "run", "--accelerator", "cpu", "--devices", "2", str(script)],
               timeout=180)
    assert done.returncode == 0, done.stderr
    assert "RANK 0 of 2" in done.stdout and "RANK 1 of 2" in done.stdout
    assert HINT not in done.stderr + done.stdout, done.stderr
    plain = python(script, timeout=180)  # the negative control: no launcher chosen, srun on PATH -> the hint
    assert plain.returncode == 0, plain.stderr
    assert HINT in plain.stderr, plain.stderr
