"""Restarts under `fabriclite run --max-restarts N`, with real processes on 2 ranks: a rank killed mid-epoch or
inside a save is restarted and the run ends with the weights of an uninterrupted run, bit for bit (with
synchronous saves, and with asynchronous ones: AsyncCheckpointIO); restarts used up fail naming the last failure;
a failure in a restart's rendezvous counts as a round; bad flags."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, Optional

import pytest

from restart_harness import REFERENCE, keep_reference, reference_job, run_many, same, weights


#: the module's jobs run in its first test's fixture, at most restart_harness.MAX_JOBS at once: measured 263 s at load
#: 13-20 on the 2 cores (over pytest's default 300 s at load 20-36); the bound is 4.5x the measured time
pytestmark = pytest.mark.timeout(1200)

#: bad flags and the message each must end with (one error line, exit 2, before anything starts)
BAD_FLAGS = [
    (["--max-restarts", "-1"], "--max-restarts='-1': expected a whole number >= 0"),
    (["--max-restarts", "two"], "--max-restarts='two': expected a whole number >= 0"),
    (["--restart-window", "soon"], "--restart-window='soon': expected a number of seconds"),
]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, tuple]:
    """Every job of this module (and the uninterrupted reference run if no test made it yet), at once in two
    waves: name -> (CompletedProcess, its directory)."""
    names = ("kill", "save", "kill_async", "save_async", "used_up", "rendezvous", "reference",
             *(f"bad_{i}" for i in range(len(BAD_FLAGS))))
    tmp = {name: tmp_path_factory.mktemp(name) for name in names}

    def job(name, flags, **env):
        return flags, {"CKPT_DIR": str(tmp[name] / "ckpt"), "OUT": str(tmp[name] / "w.pt"), **env}

    specs = {
        "kill": job("kill", ["--max-restarts", "2"], KILL_AT="13:1"),
        "save": job("save", ["--max-restarts", "1"], KILL_IN_SAVE="15"),
        "used_up": job("used_up", ["--max-restarts", "1"], KILL_AT="3:1", KILL_ALWAYS="1", STEPS="6"),
        "rendezvous": job("rendezvous", ["--max-restarts", "2"], KILL_AT="3:0", FAIL_EARLY="1:1", STEPS="6"),
        **{f"bad_{i}": job(f"bad_{i}", flags) for i, (flags, _) in enumerate(BAD_FLAGS)},  # with the others
    }
    if not REFERENCE:
        specs["reference"] = reference_job(tmp["reference"])
    script = tmp["kill"] / "script_mode.py"
    script.write_text(SCRIPT_MODE)
    script_mode = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                   "FABRICLITE_RESTART_BACKOFF": "0.05"})
    done = run_many(specs)
    done.update(run_many({  # a second wave: ten jobs at once outlast the deadline on a loaded 2-core machine
        "kill_async": job("kill_async", ["--max-restarts", "2"], KILL_AT="13:1", ASYNC="1"),
        "save_async": job("save_async", ["--max-restarts", "1"], KILL_IN_SAVE="15", ASYNC="1"),  # in the background
    }))
    out, err = script_mode.communicate(timeout=240)
    done["script_mode"] = subprocess.CompletedProcess(script_mode.args, script_mode.returncode, out, err)
    tmp["script_mode"] = tmp["kill"]
    if "reference" in done:
        keep_reference(done["reference"], tmp["reference"])
    return {name: (result, tmp[name]) for name, result in done.items()}


@pytest.mark.parametrize("saves", ["", "_async"], ids=["sync", "async"])
def test_a_rank_killed_mid_epoch_is_restarted_and_ends_with_the_uninterrupted_weights(jobs, saves):
    done, tmp_path = jobs["kill" + saves]
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "rank 1 (local rank 1, node 0) was killed by SIGKILL" in err  # the failure, printed when it happened
    assert "restarting every rank now (round 1, restart 1 of 2)" in err  # the first restart: immediate
    assert "round 0: failed: rank 1 (local rank 1, node 0) was killed by SIGKILL" in err  # the final summary
    assert "round 1: succeeded" in err
    # step 10 is mid-epoch (8 a epoch); an asynchronous save of step 10 may still be in flight when rank 1 dies at
    # step 13: then it never counts, and the newest complete checkpoint is step 5's
    resumed = ["ROUND 1 resumed from step-0010.ckpt at step 10"] + (
        ["ROUND 1 resumed from step-0005.ckpt at step 5"] if saves else [])
    assert any(line in done.stdout for line in resumed), done.stdout
    assert same(weights(str(tmp_path / "w.pt")), REFERENCE[0])
    kept = json.loads((tmp_path / "ckpt" / "fabriclite-manifest.json").read_text())["checkpoints"]
    assert [e["name"] for e in kept] == ["step-0010.ckpt", "step-0015.ckpt", "step-0020.ckpt"]
    assert len({e["run_id"] for e in kept}) == 1  # one run id across the rounds


@pytest.mark.parametrize("saves", ["", "_async"], ids=["sync", "async"])
def test_a_rank_killed_inside_a_save_is_restarted_and_ends_with_the_uninterrupted_weights(jobs, saves):
    done, tmp_path = jobs["save" + saves]
    assert done.returncode == 0, done.stderr
    assert "rank 0 (local rank 0, node 0) was killed by SIGKILL" in done.stderr
    assert "ROUND 1 resumed from step-0010.ckpt at step 10" in done.stdout  # the half-written 15 never counted
    assert same(weights(str(tmp_path / "w.pt")), REFERENCE[0])
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".fabriclite-manifest.lock", "fabriclite-manifest.json",
                                                     "step-0010.ckpt", "step-0015.ckpt", "step-0020.ckpt"]


def test_when_the_restarts_are_used_up_the_job_fails_naming_the_last_failure(jobs):
    done, _ = jobs["used_up"]
    assert done.returncode == 137, done.stderr
    err = done.stderr
    assert "round 0: failed: rank 1" in err and "round 1: failed: rank 1" in err
    assert ("not restarting: the 1 restarts (--max-restarts) are used up; the job failed, last failure: rank 1 "
            "(local rank 1, node 0) was killed by SIGKILL.") in err


def test_a_failure_in_a_restarts_rendezvous_counts_as_a_round(jobs):
    done, _ = jobs["rendezvous"]
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "round 0: failed: rank 0" in err
    assert "round 1: failed: rank 1 (local rank 1, node 0) exited with code 3" in err
    assert "round 2: succeeded" in err and "3 rounds (2 of 2 restarts used)" in err
    assert "DONE round 2" in done.stdout


SCRIPT_MODE = """
import os
from fabriclite import Fabric

fabric = Fabric(accelerator="cpu", devices=2, max_restarts=1)  # script mode: this process supervises
fabric.launch()
if fabric.restart_count == 0 and fabric.global_rank == 1:
    raise ValueError("rank 1 fails in round 0")
fabric.barrier()  # rank 0 of round 0 waits here until it is stopped
print(f"RANK {fabric.global_rank} ROUND {fabric.restart_count} MAX {os.environ['FABRICLITE_MAX_RESTARTS']}", flush=True)
"""


def test_script_mode_restarts_with_max_restarts_in_the_code(jobs):
    done, _ = jobs["script_mode"]
    assert done.returncode == 0, done.stderr
    assert "rank 1 (local rank 1, node 0) raised ValueError: rank 1 fails in round 0" in done.stderr
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("RANK")) == [
        "RANK 0 ROUND 1 MAX 1", "RANK 1 ROUND 1 MAX 1"]


@pytest.mark.parametrize("index", range(len(BAD_FLAGS)), ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_restart_flags_are_one_error_line_before_anything_starts(jobs, index):
    done, tmp_path = jobs[f"bad_{index}"]  # started with the module's other jobs (each start-up imports torch)
    message = BAD_FLAGS[index][1]
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.strip().splitlines()[-1].startswith(f"fabriclite run: error: {message}"), done.stderr
    assert not os.listdir(tmp_path)  # nothing started: no checkpoint directory


def _conflict(env: Optional[Dict[str, str]], **kwargs):
    from fabriclite import Fabric

    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        return Fabric(**kwargs)
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_max_restarts_in_code_that_cannot_take_effect_is_an_error():
    with pytest.raises(ValueError, match=r"max_restarts=3\) differs from FABRICLITE_MAX_RESTARTS=2"):
        _conflict({"FABRICLITE_MAX_RESTARTS": "2"}, accelerator="cpu", devices=2, max_restarts=3)
    with pytest.raises(ValueError, match="torchrun --max-restarts"):
        _conflict({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                   "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                   "TORCHELASTIC_RESTART_COUNT": "0"}, accelerator="cpu", devices=1, max_restarts=1)
    with pytest.raises(ValueError, match="cannot be restarted"):
        _conflict(None, accelerator="cpu", devices=2, strategy="ddp_spawn", max_restarts=1)
    with pytest.raises(ValueError, match="runs in this one process"):
        _conflict(None, accelerator="cpu", devices=1, max_restarts=1)
    assert _conflict({"FABRICLITE_MAX_RESTARTS": "2"}, accelerator="cpu", devices=2)._connector.max_restarts == 2
