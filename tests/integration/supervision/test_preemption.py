"""Preemption: SIGUSR1 / SIGTERM to the supervisor, the ranks' agreement (check_preempted, on_preempt), the
check_preempted save, exit 75 and a second launch that ends with the uninterrupted weights bit for bit, the
requeue signal (`--requeue-signal`) and a program's own handler for it. SLURM's requeue itself (`scontrol requeue`
after the signal, its opt-outs, array tasks, plain srun ranks) runs against a real SLURM in the SLURM engine lane
(tests/integration/engines/lane_slurm)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from restart_harness import (REFERENCE, fabriclite_run, finish, keep_reference, reference_job, same, signal_when, start,
                             weights)


def test_sigusr1_then_the_check_preempted_save_exit_75_and_a_second_launch_give_the_uninterrupted_weights(
        tmp_path):
    env = {"CKPT_DIR": str(tmp_path / "ckpt"), "OUT": str(tmp_path / "w.pt"), "CHECK_PREEMPTED": "1"}
    ref_flags, ref_env = reference_job(tmp_path / "reference")
    ref = None if REFERENCE else start(ref_flags, ref_env)  # the uninterrupted run, alongside
    proc = start([], {**env, "WAIT_AT": "7"})
    before = signal_when(proc, "WAITING", signal.SIGUSR1)  # rank 0 waits mid-epoch, right after step 7
    code, out, err = finish(proc)
    assert code == 75, err
    assert "PREEMPTED saved at step 7" in before + out
    assert "fabriclite: preempted (SIGUSR1); exit code 75 (preempted, resumable" in err
    assert not (tmp_path / "w.pt").exists()
    if ref is not None:
        ref_code, ref_out, ref_err = finish(ref)
        keep_reference(subprocess.CompletedProcess(ref.args, ref_code, ref_out, ref_err), tmp_path / "reference")
    again = fabriclite_run([], env)  # the same command again
    assert again.returncode == 0, again.stderr
    assert "ROUND 0 resumed from step-0007.ckpt at step 7" in again.stdout
    assert same(weights(str(tmp_path / "w.pt")), REFERENCE[0])


WAITER = r'''
import os, sys, time
from fabriclite import Fabric
from fabriclite.supervision.rank import signals as preemption

class Hook:
    def on_preempt(self, fabric):
        print(f"HOOK rank {fabric.global_rank}", flush=True)

fabric = Fabric(accelerator="cpu", callbacks=[Hook()])
fabric.launch()
assert not fabric.check_preempted() and not fabric.preempted
print(f"READY {fabric.global_rank}", flush=True)
fabric.barrier()
if fabric.global_rank == 0:
    print("ALL READY", flush=True)
deadline = time.monotonic() + 120
while preemption.received() is None and time.monotonic() < deadline:  # the signal, forwarded by the supervisor
    time.sleep(0.01)
agreed = [fabric.check_preempted(), fabric.check_preempted()]  # the hook runs once
print(f"AGREED {fabric.global_rank} {agreed} {fabric.preempted}", flush=True)
'''


def test_the_requeue_signal_and_sigterm_reach_every_rank_once(tmp_path):
    script = tmp_path / "waiter.py"
    script.write_text(textwrap.dedent(WAITER))
    jobs = {  # name: (flags, signal): no SLURM job here, so nothing is requeued and every job exits 75
        "usr1": ([], signal.SIGUSR1),
        "sigterm": ([], signal.SIGTERM),
        "usr2": (["--requeue-signal", "USR2"], signal.SIGUSR2),  # the configured signal, forwarded and recorded
    }
    procs = {name: start(flags, {}, str(script)) for name, (flags, _) in jobs.items()}
    for name, proc in procs.items():
        signal_when(proc, "ALL READY", jobs[name][1])
    for name, proc in procs.items():
        code, out, err = finish(proc)
        assert "HOOK rank 0" in out and "HOOK rank 1" in out and out.count("HOOK") == 2, (name, out)
        assert "AGREED 0 [True, True] True" in out and "AGREED 1 [True, True] True" in out, (name, out)
        assert code == 75, (name, err)
        assert f"preempted ({jobs[name][1].name}); exit code 75" in err, (name, err)
        assert "requeue" not in err.replace("(preempted, resumable", ""), (name, err)


OWN_HANDLER = r'''
import os, signal
from fabriclite import Fabric
from fabriclite.supervision.rank import signals as rank_signals

def submitit_like(signum, frame):  # a program's own handler for the requeue signal (submitit installs one)
    print("OWN HANDLER", flush=True)

signal.signal(signal.SIGUSR2, submitit_like)
fabric = Fabric(accelerator="cpu")
fabric.launch()
os.kill(os.getpid(), signal.SIGUSR2)
print("RECORDED", rank_signals.received(), fabric.check_preempted(), flush=True)
'''


def test_a_program_that_handles_the_requeue_signal_keeps_its_handler_and_is_told_once(tmp_path):
    script = tmp_path / "own.py"
    script.write_text(OWN_HANDLER)
    done = fabriclite_run(["--devices", "2", "--requeue-signal", "USR2"], {}, script=str(script), timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("OWN HANDLER") == 2 and done.stdout.count("RECORDED None False") == 2, done.stdout
    told = [line for line in done.stderr.splitlines() if "already handles SIGUSR2" in line]
    assert len(told) == 1 and told[0] == (  # once per job: global rank 0
        "fabriclite: this program already handles SIGUSR2 (handler __main__.submitit_like); fabriclite leaves it "
        "alone: it does not record SIGUSR2 for fabric.check_preempted() and does not requeue the job after it (the "
        "program's handler does that, as submitit's does)."), done.stderr


def test_bad_preempt_grace_is_one_error_line(tmp_path):
    done = fabriclite_run(["--preempt-grace", "-3"], {"CKPT_DIR": str(tmp_path)}, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(
        "fabriclite run: error: --preempt-grace='-3': expected a number of seconds >= 0"), done.stderr


# ---------------------------------------------------------------------- in process, on the pool's ranks
def _agree_on_one_ranks_signal(fabric):
    from fabriclite.supervision.rank import signals as preemption

    calls = []

    class Hook:
        def on_preempt(self, fab):
            calls.append(fab.global_rank)

    fabric._callbacks.append(Hook())
    try:
        before = fabric.check_preempted()
        if fabric.global_rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # recorded, not fatal
            deadline = time.monotonic() + 30
            while preemption.received() is None and time.monotonic() < deadline:
                time.sleep(0.001)
        answers = [fabric.check_preempted() for _ in range(3)]
        return before, answers, fabric.preempted, calls
    finally:
        fabric._callbacks.pop()
        fabric._preempted = False
        preemption._received = None


def test_check_preempted_agrees_on_every_rank_and_calls_the_hook_once(pool2):
    for before, answers, preempted, calls in pool2.run(_agree_on_one_ranks_signal):
        assert before is False and answers == [True, True, True] and preempted is True
        assert len(calls) == 1


SLEEPER = r'''
import time
from fabriclite import Fabric
fabric = Fabric(accelerator="cpu")
fabric.launch()
fabric.barrier()
if fabric.global_rank == 0:
    print(f"ALL READY round {fabric.restart_count}", flush=True)
time.sleep(120)  # never checks for preemption: the grace period runs out and the supervisor stops the ranks
'''


def test_a_preempted_job_is_never_restarted_by_max_restarts(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = start(["--max-restarts", "2", "--preempt-grace", "1"], {}, script=str(script))
    signal_when(proc, "ALL READY round 0", signal.SIGTERM)  # a real signal to the real supervisor
    code, out, err = finish(proc)
    assert code == 75, err
    assert "not restarting: the job was interrupted or preempted" in err, err
    assert "restarting every rank" not in err and "ALL READY round 1" not in out, (out, err)
