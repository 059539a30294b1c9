"""examples/fault_tolerant.py (the README's example) under `fabriclite run --max-restarts 3`: rank 1 crashes once,
the job restarts from the newest checkpoint and finishes; three checkpoints are kept."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from helpers import REPO as REPO_PATH

REPO = str(REPO_PATH)


def test_the_readme_example_restarts_and_finishes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FABRICLITE_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env.update({"OMP_NUM_THREADS": "1", "FABRICLITE_RESTART_BACKOFF": "0.05"})
    ckpt = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2",
                           "--max-restarts", "3", os.path.join(REPO, "examples", "fault_tolerant.py"),
                           "--ckpt", str(ckpt), "--crash-at", "27"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "round 0: starting at step 0 (from None)" in done.stdout
    assert f"round 1: starting at step 20 (from {ckpt / 'step-000020.ckpt'})" in done.stdout
    assert "done at step 40" in done.stdout
    assert "RuntimeError: rank 1 crashes at step 27" in done.stderr
    kept = json.loads((ckpt / "fabriclite-manifest.json").read_text())["checkpoints"]
    assert [e["name"] for e in kept] == ["step-000020.ckpt", "step-000030.ckpt", "step-000040.ckpt"]
