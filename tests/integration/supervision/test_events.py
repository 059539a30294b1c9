"""The events record and goodput (supervision/watch/events.py, supervision/watch/goodput.py) of a real
crash-and-restart run: `fabriclite run --max-restarts 1` on 2 ranks, with known amounts injected: a backoff of
BACKOFF_S, a checkpoint whose saving blocks the loop for at least BLOCK_S (a state object that sleeps in
``state_dict``), and rank 1 killing itself REDONE steps after that checkpoint, so that the restart redoes them. The
events file is parsed as docs/reliability.md shows, and each injected amount comes back as its part of the goodput
line within a stated margin."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from faults_harness import clean_env

pytestmark = pytest.mark.slow

BACKOFF_S, BLOCK_S, REDONE, STEP_S = 2.0, 1.5, 6, 0.15
#: each part's allowance above what was injected: stopping the failed round (SIGTERM, interpreters' exits) adds to
#: the restart; steps' own compute and the supervisor's 0.5 s polling add to the redone steps and the stall. Measured
#: on the loaded 2-core machine: restart +0.3..1.5 s, redone +0.1..0.4 s, stall +0.05..0.3 s; x3-5 margins
MARGIN_S = {"restart": 6.0, "redone": 2.5, "checkpoint": 1.5}

SCRIPT = r'''
import os, signal, time
import torch
from fabriclite import Fabric

STEPS, SAVE_AT, KILL_AT = 24, 8, 8 + int(os.environ["REDONE"])


class Slow:  # a checkpoint that blocks the loop for a known time
    def state_dict(self):
        time.sleep(float(os.environ["BLOCK_S"]))
        return {}

    def load_state_dict(self, state):
        pass


fabric = Fabric()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
state = {"model": model, "optimizer": optimizer, "step": 0, "slow": Slow()}
fabric.load_latest(os.environ["CKPT"], state)
while state["step"] < STEPS:
    x = torch.randn(8, 4)
    fabric.backward(model(x).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    state["step"] += 1
    time.sleep(float(os.environ["STEP_S"]))
    if state["step"] == SAVE_AT:
        fabric.save(os.path.join(os.environ["CKPT"], f"step-{state['step']}.ckpt"), state, keep=2)
    if state["step"] == KILL_AT and fabric.global_rank == 1 and fabric.restart_count == 0:
        os.kill(os.getpid(), signal.SIGKILL)
'''


@pytest.fixture(scope="module")
def crash_and_restart(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("events")
    script = tmp / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {"FABRICLITE_FIRST_RESTART_BACKOFF": str(BACKOFF_S), "REDONE": str(REDONE), "BLOCK_S": str(BLOCK_S),
           "STEP_S": str(STEP_S), "CKPT": str(tmp / "ckpt"), "FABRICLITE_RUN_ID": "events_test",
           "XDG_STATE_HOME": str(tmp / "state")}
    done = subprocess.run([sys.executable, "-m", "fabriclite", "run", "--accelerator", "cpu", "--devices", "2",
                           "--strategy", "ddp", "--max-restarts", "1", str(script)], cwd=tmp, env=clean_env(env),
                          capture_output=True, text=True, timeout=300)
    return tmp, done


def test_the_events_file_of_a_crash_and_restart_run(crash_and_restart) -> None:
    tmp, done = crash_and_restart
    assert done.returncode == 0, done.stdout + done.stderr
    path = tmp / "state" / "fabriclite" / "runs" / "events_test" / "events-node0.jsonl"  # no --log-dir: the run's
    assert not (tmp / "fabriclite_logs").exists()  # folder, not the working directory
    events = [json.loads(line) for line in path.read_text().splitlines()]  # docs/reliability.md's Python reader
    assert {e["schema"] for e in events} == {"fabriclite.events/2"} and {e["run"] for e in events} == {"events_test"}
    names = [e["event"] for e in events]
    expected = ["job_start", "round_start", "restore", "ranks_up", "checkpoint", "failure", "round_end", "restart",
                "round_start", "restore", "ranks_up", "round_end", "job_end"]
    assert [n for n in names if n in expected] == expected, names
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["rank"] == 1 and "SIGKILL" in failure["cause"] and failure["hang"] is False, failure
    first, restore = [e for e in events if e["event"] == "restore"]
    assert first["source"] is None and first["round"] == 0, first  # nothing to load on the first start
    assert restore["source"].endswith("step-8.ckpt") and restore["round"] == 1, restore
    assert next(e for e in events if e["event"] == "restart")["backoff"] == BACKOFF_S
    checkpoint = next(e for e in events if e["event"] == "checkpoint")
    assert checkpoint["bytes"] > 0 and checkpoint["step"] == 8 and checkpoint["path"].endswith("step-8.ckpt")
    ends = [e for e in events if e["event"] == "round_end"]
    assert [e["steps"] for e in ends] == [8 + REDONE, 24 - 8] and ends[1]["exit_code"] == 0, ends


def test_the_goodput_line_gives_back_the_injected_amounts(crash_and_restart) -> None:
    _, done = crash_and_restart
    lines = [line for line in done.stderr.splitlines() if line.startswith("fabriclite: goodput")]
    assert len(lines) == 1, done.stderr
    line = lines[0]
    parts = {name: float(value) for name, value in re.findall(r"(start-up|restart|redone steps|checkpoint stalls|"
                                                              r"preemption|other) ([\d.]+) s", line)}
    assert re.search(rf"redone steps [\d.]+ s \({REDONE} steps\)", line), line
    assert BACKOFF_S <= parts["restart"] <= BACKOFF_S + MARGIN_S["restart"], line
    # from the checkpoint's end to the last step's optimizer step: REDONE steps, of which REDONE - 1 sleeps
    assert (REDONE - 1) * STEP_S <= parts["redone steps"] <= REDONE * STEP_S + MARGIN_S["redone"], line
    # one save (round 1 resumes after it), blocked at least BLOCK_S
    assert BLOCK_S <= parts["checkpoint stalls"] <= BLOCK_S + MARGIN_S["checkpoint"], line
    assert parts["preemption"] == 0.0 and parts["start-up"] > 0, line
    share, good, wall = re.search(r"goodput ([\d.]+)% \(([\d.]+) s of ([\d.]+) s", line).groups()
    # steps that counted: 24 steps of at least STEP_S each (less the first of each round: it is in the start-up)
    assert (24 - 2) * STEP_S <= float(good) <= float(wall) and float(share) > 0, line
