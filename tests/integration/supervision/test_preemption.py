"""Preemption: SIGUSR1 / SIGTERM to the supervisor, the ranks' agreement (check_preempted, on_preempt), the
check_preempted save, exit 75 and a second launch that ends with the uninterrupted weights bit for bit, and
SLURM's requeue checked with a stub `scontrol` on PATH that records its arguments."""
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
from fabriclite.supervision import rank_signals as preemption

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


@pytest.fixture()
def stub_scontrol(tmp_path):
    """A `scontrol` on PATH that appends its arguments to a file and exits with $STUB_CODE."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "scontrol.args"
    stub = bin_dir / "scontrol"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {record}\nexit ${{STUB_CODE:-0}}\n')
    stub.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, record


def test_slurm_requeue_after_sigusr1_and_its_opt_outs(tmp_path, stub_scontrol):
    path_env, record = stub_scontrol
    script = tmp_path / "waiter.py"
    script.write_text(textwrap.dedent(WAITER))
    slurm = {**path_env, "SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "3"}
    jobs = {  # name: (flags, env, signal)
        "requeued": ([], slurm, signal.SIGUSR1),
        "opted_out": (["--no-requeue"], slurm, signal.SIGUSR1),
        "sigterm": ([], {**slurm, "FABRICLITE_REQUEUE": "1"}, signal.SIGTERM),  # SIGTERM never requeues
    }
    procs = {name: start(flags, env, str(script)) for name, (flags, env, _) in jobs.items()}
    for name, proc in procs.items():
        signal_when(proc, "ALL READY", jobs[name][2])
    results = {name: finish(proc) for name, proc in procs.items()}
    code, out, err = results["requeued"]
    assert code == 0, err
    assert "fabriclite: requeued SLURM job 77_3 (scontrol requeue 77_3)." in err
    assert record.read_text().splitlines() == ["requeue 77_3"]  # once, by node 0's supervisor, after the ranks
    for name in ("requeued", "opted_out", "sigterm"):
        code, out, err = results[name]
        assert "HOOK rank 0" in out and "HOOK rank 1" in out and out.count("HOOK") == 2, (name, out)
        assert "AGREED 0 [True, True] True" in out and "AGREED 1 [True, True] True" in out, (name, out)
        if name != "requeued":
            assert code == 75, (name, err)
            assert f"preempted ({jobs[name][2].name}); exit code 75" in err, (name, err)


def test_bad_preempt_grace_is_one_error_line(tmp_path):
    done = fabriclite_run(["--preempt-grace", "-3"], {"CKPT_DIR": str(tmp_path)}, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(
        "fabriclite run: error: --preempt-grace='-3': expected a number of seconds >= 0"), done.stderr


# ---------------------------------------------------------------------- in process, on the pool's ranks
def _agree_on_one_ranks_signal(fabric):
    from fabriclite.supervision import rank_signals as preemption

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


def test_without_a_supervisor_global_rank_0_requeues_at_exit(tmp_path, stub_scontrol):
    path_env, record = stub_scontrol
    script = tmp_path / "alone.py"
    script.write_text(textwrap.dedent('''
        import os, signal
        from fabriclite import Fabric
        from fabriclite.supervision import rank_signals as preemption
        fabric = Fabric(accelerator="cpu", devices=1)  # as srun would start it: no fabriclite supervisor
        fabric.launch()
        os.kill(os.getpid(), signal.SIGUSR1)  # recorded, not fatal
        print("RECORDED", preemption.received() == signal.SIGUSR1, fabric.check_preempted(), flush=True)
    '''))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FABRICLITE_", "SLURM_"))}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**env, **path_env, "SLURM_JOB_ID": "99", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert "RECORDED True True" in done.stdout
    assert record.read_text().splitlines() == ["requeue 99"]
    assert "fabriclite: requeued SLURM job 99 (scontrol requeue 99)." in done.stderr


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
