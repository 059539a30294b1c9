"""Checkpoint durability under faults, with real processes (2 CPU ranks under `fabriclite run`, gloo):

- the bit-exact restart run with asynchronous sharded saves (FSDPStrategy(async_save=True)), a rank SIGKILLed
  mid-epoch: the same final weights as an uninterrupted fsdp run (ddp's with AsyncCheckpointIO, mid-epoch and
  inside the background write: tests/integration/supervision/test_restarts.py);
- a non-zero rank SIGKILLed while it writes its shard of a sharded checkpoint: that checkpoint never becomes the
  latest, the restarted job resumes from the previous one and ends with the uninterrupted fsdp run's weights;
- preemption with a save in flight: the exit waits for it (recorded, exit 75); a second signal stops the job at
  once, and the newest complete checkpoint is the one load_latest finds;
- node 0's supervisor SIGKILLed during a restart (in the backoff, and while the new round loads): no process of
  the job is left, the newest complete checkpoint loads.

Every job of the module starts at once (each start-up imports torch twice): the ``jobs`` fixture.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from faults_harness import living
from restart_harness import DEADLINE_S, SCRIPT, finish, run_many, same, signal_when, start, weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: a second signal during the grace ends the job at once: measured 0.25 s from the signal to the supervisor's exit
#: on the shared 2-core machine at load average 11; the bound leaves a 60x margin for heavier load
SECOND_SIGNAL_BOUND_S = 15.0


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, tuple]:
    """name -> (CompletedProcess, its directory), every job run at once."""
    names = ("fsdp_reference", "fsdp_shard_kill", "fsdp_async_kill")
    tmp = {name: tmp_path_factory.mktemp(name) for name in names}

    def job(name, flags, **env):
        return flags, {"CKPT_DIR": str(tmp[name] / "ckpt"), "OUT": str(tmp[name] / "w.pt"), **env}

    specs = {
        "fsdp_reference": job("fsdp_reference", [], STRATEGY="fsdp"),
        "fsdp_shard_kill": job("fsdp_shard_kill", ["--max-restarts", "1"], STRATEGY="fsdp", KILL_IN_SHARD="15:1"),
        "fsdp_async_kill": job("fsdp_async_kill", ["--max-restarts", "1"], STRATEGY="fsdp", ASYNC="1",
                               KILL_AT="13:1"),
    }
    done = run_many(specs)
    return {name: (result, tmp[name]) for name, result in done.items()}


def _recorded(ckpt: Path) -> List[str]:
    return [e["name"] for e in json.loads((ckpt / "fabriclite-manifest.json").read_text())["checkpoints"]]


def test_a_non_zero_rank_killed_while_writing_its_shard_resumes_from_the_previous_checkpoint(jobs):
    reference, _ = jobs["fsdp_reference"]
    done, tmp = jobs["fsdp_shard_kill"]
    assert reference.returncode == 0, reference.stderr
    assert done.returncode == 0, done.stderr
    assert "KILLED IN SHARD" in done.stdout
    assert "rank 1 (local rank 1, node 0) was killed by SIGKILL" in done.stderr
    assert "ROUND 1 resumed from step-0010.ckpt at step 10" in done.stdout  # the half-written 15 never counted
    assert same(weights(str(tmp / "w.pt")), weights(str(jobs["fsdp_reference"][1] / "w.pt")))
    assert _recorded(tmp / "ckpt") == ["step-0010.ckpt", "step-0015.ckpt", "step-0020.ckpt"]
    assert sorted(os.listdir(tmp / "ckpt" / "step-0015.ckpt")) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                                   "meta.pt"]


def test_sharded_async_saves_keep_restarts_bit_exact(jobs):
    done, tmp = jobs["fsdp_async_kill"]
    assert done.returncode == 0, done.stderr
    # step 10's save may still be in flight when rank 1 dies at step 13: then the newest complete one is step 5's
    assert ("ROUND 1 resumed from step-0010.ckpt at step 10" in done.stdout
            or "ROUND 1 resumed from step-0005.ckpt at step 5" in done.stdout), done.stdout
    assert same(weights(str(tmp / "w.pt")), weights(str(jobs["fsdp_reference"][1] / "w.pt")))
    assert not [n for n in os.listdir(tmp / "ckpt") if ".tmp-" in n]  # round 0's temporaries were cleaned up


# ---------------------------------------------------------------------- preemption with a save in flight
PREEMPTED_SAVE = r'''
import os, time
from torch import nn
from fabriclite import Fabric
from fabriclite.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

class SlowIO(TorchCheckpointIO):  # a slow store: the write of "late" takes SLOW_S seconds
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if "late" in os.path.basename(path):
            print("WRITING LATE", flush=True)
            time.sleep(float(os.environ["SLOW_S"]))
        super().save_checkpoint(checkpoint, path, storage_options)

fabric = Fabric(accelerator="cpu", plugins=[AsyncCheckpointIO(SlowIO())])
fabric.launch()
model = fabric.setup(nn.Linear(4, 4))
ckpt = os.environ["CKPT_DIR"]
fabric.save(f"{ckpt}/early.ckpt", {"model": model, "step": 1}, keep=3)
fabric.barrier()
if fabric.global_rank == 0:
    print("READY", flush=True)
while not fabric.check_preempted():
    time.sleep(0.05)
fabric.save(f"{ckpt}/late.ckpt", {"model": model, "step": 2}, keep=3)
fabric.print("SAVE IN FLIGHT", flush=True)
'''


def _latest(ckpt: Path):
    from fabriclite import Fabric

    state = {"step": -1}
    path = Fabric(accelerator="cpu", devices=1).load_latest(ckpt, state)
    return os.path.basename(path), state["step"]


def test_preemption_waits_for_the_save_in_flight_and_a_second_signal_does_not(tmp_path):
    script = tmp_path / "preempted_save.py"
    script.write_text(PREEMPTED_SAVE)
    waits = start([], {"CKPT_DIR": str(tmp_path / "waits"), "SLOW_S": "2"}, str(script))
    second = start([], {"CKPT_DIR": str(tmp_path / "second"), "SLOW_S": "600"}, str(script))
    signal_when(waits, "READY", signal.SIGUSR1)
    signal_when(second, "READY", signal.SIGUSR1)
    signal_when(second, "WRITING LATE", signal.SIGUSR1)  # the second signal, while rank 0 writes in the background
    signalled = time.monotonic()
    code, out, err = finish(second)
    took = time.monotonic() - signalled
    print(f"second signal -> the supervisor's exit: {took:.2f} s")
    assert code == 138, err  # stopped at once (128 + SIGUSR1): no hang on the write in flight
    assert took < SECOND_SIGNAL_BOUND_S, f"{took:.1f} s after the second signal"
    assert _recorded(tmp_path / "second") == ["early.ckpt"] and _latest(tmp_path / "second") == ("early.ckpt", 1)
    code, out, err = finish(waits)
    assert code == 75, err  # preempted, and every rank's exit waited for the save in flight
    assert _recorded(tmp_path / "waits") == ["early.ckpt", "late.ckpt"]
    assert _latest(tmp_path / "waits") == ("late.ckpt", 2)


# ---------------------------------------------------------------------- node 0's supervisor killed in a restart
def _processes_running(script: str) -> List[str]:
    """The processes whose command line names ``script`` (this test's own copy: nothing else runs it)."""
    return [p for p in living(pids=_pids_of(script))]


def _pids_of(script: str) -> List[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if script in Path(f"/proc/{entry}/cmdline").read_text():
                    found.append(int(entry))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("moment", ["backoff", "loading"])
def test_node_0s_supervisor_killed_during_a_restart_leaves_nothing_and_the_newest_checkpoint_loads(tmp_path, moment):
    script = str(tmp_path / "restart_copy.py")
    shutil.copy(SCRIPT, script)
    env = {"CKPT_DIR": str(tmp_path / "ckpt"), "OUT": str(tmp_path / "w.pt"), "KILL_AT": "13:1",
           "FABRICLITE_FIRST_RESTART_BACKOFF": "30" if moment == "backoff" else "0", "ASYNC": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2",
                             "--max-restarts", "2", script], env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = "restarting every rank in" if moment == "backoff" else "ROUND 1 resumed"
    seen = []
    deadline = time.monotonic() + DEADLINE_S
    for line in proc.stdout:  # type: ignore[union-attr]
        seen.append(line)
        if marker in line:
            proc.kill()  # SIGKILL node 0's supervisor (it hosts the job's store)
            killed = time.monotonic()
            break
        assert time.monotonic() < deadline, "".join(seen)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(seen)
    deadline = time.monotonic() + 10  # ranks die with their supervisor (PDEATHSIG): measured 0.23-0.26 s at load 11
    while _processes_running(script) and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"{moment}: every process of the job gone {time.monotonic() - killed:.2f} s after the SIGKILL")
    assert not _processes_running(script), "".join(seen)
    # step 10's, or step 5's if step 10's async save was cut short; on a loaded machine the ranks of round 1 may
    # also record step 15 (or 20) before the SIGKILL lands (the marker reaches this test through two pipes)
    newest = _recorded(tmp_path / "ckpt")[-1]
    assert newest in ("step-0005.ckpt", "step-0010.ckpt") + (("step-0015.ckpt", "step-0020.ckpt")
                                                             if moment == "loading" else ())
    assert _latest(tmp_path / "ckpt") == (newest, int(newest[5:9]))  # it loads, its checksums hold
