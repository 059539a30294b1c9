"""Nothing is written where the user did not point: real jobs leave their working directory as they found it (what
Lightning's test harness checks after each test: "Test left artifacts behind"), and their events record lands in the
run's folder instead (docs/reliability.md, "Events and goodput").

Three jobs of 2 CPU ranks, at once, each in a working directory of its own: ``fabriclite run`` of the demo (no
training step: no goodput line, with ``$XDG_STATE_HOME`` unset, so under ``~/.local/state``), script mode with a
rank that raises (the summary names the run's folder; the failure gets the goodput line), and torchrun (the ranks'
own events, without a supervisor)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from helpers import REPO, clean_env

pytestmark = pytest.mark.slow

#: one optimizer step and a save (a ``checkpoint`` event from global rank 0), then rank 1 raises if asked
SCRIPT = """
import sys
import torch
from fabriclite import Fabric

fabric = Fabric(accelerator="cpu", devices=2)
fabric.launch()
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
fabric.backward(model(torch.ones(2, 4)).sum())
optimizer.step()
fabric.save(sys.argv[1] + "/state.ckpt", {"model": model})
if len(sys.argv) > 2 and fabric.global_rank == 1:
    raise RuntimeError("boom on purpose")
"""


def snapshot(folder: Path) -> Dict[str, Tuple[int, int]]:
    """Every path under ``folder`` with its size and modification time."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            stat = path.lstat()
            found[str(path.relative_to(folder))] = (stat.st_size, stat.st_mtime_ns)
    return found


def events_in(state: Path) -> List[dict]:
    """Every event of every run folder under ``state`` (an XDG state home)."""
    files = sorted((state / "fabriclite" / "runs").glob("*/events-node*.jsonl"))
    return [json.loads(line) for path in files for line in path.read_text().splitlines()]


def test_jobs_leave_the_working_directory_as_they_found_it(tmp_path: Path) -> None:
    script = tmp_path / "script" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(SCRIPT))
    home, state, out = tmp_path / "home", tmp_path / "state", tmp_path / "out"
    for name in ("script", "torchrun"):
        (out / name).mkdir(parents=True)
    python = [sys.executable]
    jobs = {  # name: (command, extra environment)
        "cli": ([*python, "-m", "fabriclite", "run", "--accelerator", "cpu", "--devices", "2",
                 str(REPO / "examples" / "demo.py")], {"HOME": str(home), "XDG_STATE_HOME": ""}),
        "script": ([*python, str(script), str(out / "script"), "fail"], {"XDG_STATE_HOME": str(state)}),
        "torchrun": ([*python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
                      str(out / "torchrun")], {"XDG_STATE_HOME": str(state / "torchrun")}),
    }
    procs, before = {}, {}
    for name, (command, extra) in jobs.items():
        cwd = tmp_path / f"cwd-{name}"
        cwd.mkdir()
        (cwd / "data.txt").write_text("the user's own file\n")
        before[name] = snapshot(cwd)
        env = clean_env({"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra})
        env = {k: v for k, v in env.items() if v != "" and k not in ("FABRICLITE_LOG_DIR", "FABRICLITE_GOODPUT")}
        procs[name] = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
    done = {name: proc.communicate(timeout=240) for name, proc in procs.items()}
    output = {name: out_ + err for name, (out_, err) in done.items()}
    for name in jobs:
        assert snapshot(tmp_path / f"cwd-{name}") == before[name], (name, output[name])

    # fabriclite run of the demo: a clean short run says nothing of goodput; its record is under ~/.local/state
    assert procs["cli"].returncode == 0, output["cli"]
    assert "goodput" not in output["cli"], output["cli"]
    kinds = [e["event"] for e in events_in(home / ".local" / "state")]
    assert kinds[0] == "job_start" and kinds[-1] == "job_end", kinds

    # script mode, rank 1 raises: the summary names the run's folder, and the failure gets the goodput line
    assert procs["script"].returncode != 0, output["script"]
    folders = list((state / "fabriclite" / "runs").iterdir())
    assert len(folders) == 1 and f"this run's events are in {folders[0]}" in output["script"], output["script"]
    assert "fabriclite: goodput" in output["script"], output["script"]
    kinds = [e["event"] for e in events_in(state)]
    assert {"job_start", "checkpoint", "failure", "job_end"} <= set(kinds), kinds

    # torchrun: no supervisor; global rank 0's checkpoint event goes to the run's folder (torchrun's run id)
    assert procs["torchrun"].returncode == 0, output["torchrun"]
    assert [e["event"] for e in events_in(state / "torchrun")] == ["checkpoint"], output["torchrun"]
