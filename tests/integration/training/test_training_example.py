"""examples/train.py end to end: 2 CPU ranks under the supervising "ddp" strategy, CSV log, save, resume."""
from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest
from helpers import REPO as REPO_PATH

REPO = str(REPO_PATH)


@pytest.mark.slow
def test_example_trains_logs_saves_and_resumes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FABRICLITE_", "MASTER_", "RANK", "WORLD_SIZE"))}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train.py"), "--epochs", "3",
                           "--interrupt-after", "1", "--samples", "512", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed from" in proc.stdout and "at epoch 1" in proc.stdout
    assert proc.stdout.count("epoch 0:") == 1  # printed by rank 0 only
    with open(tmp_path / "logs" / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2"]
    assert all(0.0 <= float(r["train/acc"]) <= 1.0 and float(r["train/loss"]) > 0 for r in rows)
    assert float(rows[-1]["val/acc"]) > 0.5
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "logs"]  # no temporary checkpoint file left
