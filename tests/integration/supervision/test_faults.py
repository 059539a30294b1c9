"""Faults on one node, with real processes: a failed, killed, exiting or stuck rank, or a signal to
the supervisor, ends the whole job fast and loudly, with no process of the job left.

Every job runs the harness's FAULT_SCRIPT (script mode, spawn / fork, or under ``fabriclite run``). The
jobs of this module start together, a few at a time (``fault_jobs``), since each costs seconds of torch
start-up on a 2-core machine; each test then checks one job's outcome.
"""
from __future__ import annotations

import re
import signal
import time
from typing import Dict

import pytest

from faults_harness import (END_BOUND_S, Job, assert_failed_fast, assert_nothing_left, cli_job, kill_tree,
                                 living, run_jobs, script_job, send)

pytestmark = pytest.mark.slow


# ---------------------------------------------------------------------- the jobs, run together once
@pytest.fixture(scope="module")
def fault_jobs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Job]:
    tmp = tmp_path_factory.mktemp("faults")
    jobs = [
        script_job(tmp, "script_raise1", "raise"),
        script_job(tmp, "spawn_raise1", "raise", mode="spawn"),
        cli_job(tmp, "cli_raise1", "raise", ["--accelerator", "cpu", "--devices", "2", "--strategy", "ddp"]),
        script_job(tmp, "kill1", "kill1"),
        script_job(tmp, "exit1", "exit1"),
        script_job(tmp, "raise0_busy", "raise0_busy"),
        script_job(tmp, "kill0", "kill0", mode="fork"),
        script_job(tmp, "sleep1", "sleep1", env={"FABRICLITE_TIMEOUT": "5"}),
        script_job(tmp, "sigint", "wait", on_ready=send(signal.SIGINT), ready_ranks=2),
        script_job(tmp, "sigterm_spawn", "wait", mode="spawn", on_ready=send(signal.SIGTERM), ready_ranks=2,
                   env={"FABRICLITE_PREEMPT_GRACE": "0"}),  # a preemption notice with no grace: stop at once
        script_job(tmp, "supervisor_killed", "wait", on_ready=send(signal.SIGKILL), ready_ranks=2),
    ]
    started = time.time()
    try:
        run_jobs(jobs)
    except BaseException:
        for job in jobs:
            kill_tree(job)
        raise
    for job in jobs:
        print(job.summary_line())
    print(f"{len(jobs)} jobs in {time.time() - started:.1f} s")
    return {job.name: job for job in jobs}


@pytest.mark.parametrize("name", ["script_raise1", "spawn_raise1", "cli_raise1"])
def test_rank_1_raises_while_rank_0_waits_in_a_barrier(fault_jobs: Dict[str, Job], name: str) -> None:
    job = fault_jobs[name]
    assert_failed_fast(job)
    assert job.returncode == 1
    err = "".join(job.err)
    assert ("fabriclite: the job failed: rank 1 (local rank 1, node 0) raised ValueError: rank 1 fails on purpose"
            in err), job.output
    assert "--- rank 1 traceback ---" in err and "ValueError: rank 1 fails on purpose" in err, job.output
    assert err.count("fabriclite: the job failed") == 1, job.output  # one summary
    assert_nothing_left(job)


def test_rank_1_sigkilled(fault_jobs: Dict[str, Job]) -> None:
    job = fault_jobs["kill1"]
    assert_failed_fast(job)
    assert job.returncode == 128 + signal.SIGKILL
    assert "fabriclite: the job failed: rank 1 (local rank 1, node 0) was killed by SIGKILL" in "".join(job.err), \
        job.output
    assert_nothing_left(job)


def test_rank_1_exits_early_with_code_3(fault_jobs: Dict[str, Job]) -> None:
    job = fault_jobs["exit1"]
    assert_failed_fast(job)
    assert job.returncode == 3
    assert "fabriclite: the job failed: rank 1 (local rank 1, node 0) exited with code 3" in "".join(job.err), \
        job.output
    assert_nothing_left(job)


def test_rank_0_raises_while_rank_1_is_busy_without_collectives(fault_jobs: Dict[str, Job]) -> None:
    job = fault_jobs["raise0_busy"]
    assert_failed_fast(job)
    err = "".join(job.err)
    assert ("fabriclite: the job failed: rank 0 (local rank 0, node 0) raised RuntimeError: rank 0 fails on "
            "purpose") in err, job.output
    assert "stopping ranks [1] on node 0" in err and "--- rank 0 traceback ---" in err, job.output
    assert any("helper" in r for r in job.records), job.output  # rank 1's child, in its group, is gone too
    assert_nothing_left(job)


def test_rank_0_sigkilled_under_fork(fault_jobs: Dict[str, Job]) -> None:
    job = fault_jobs["kill0"]
    assert_failed_fast(job)
    err = "".join(job.err)
    assert "JobFailed: fabriclite: the job failed: rank 0 (local rank 0, node 0) was killed by SIGKILL" in err, \
        job.output
    assert_nothing_left(job)


def test_a_rank_that_sleeps_forever_ends_the_job_after_the_timeout(fault_jobs: Dict[str, Job]) -> None:
    job = fault_jobs["sleep1"]
    took = assert_failed_fast(job, bound=5 + END_BOUND_S)
    assert took >= 5, job.output
    err = "".join(job.err)
    # fabric.barrier() runs on the strategy's primitives (the collectives' header: an all_reduce or all_gather)
    assert re.search(r"CollectiveTimeout: fabriclite: (barrier|all_gather|all_reduce) #(\d+) timed out after 5 s on "
                     r"rank 0: ranks \[1\] did not arrive \(rank 1: last collective #\d+ "
                     r"\((barrier|all_gather|all_reduce)\)\)", err), \
        job.output
    assert "fatal for the process group" in err, job.output
    assert "stopping ranks [1] on node 0" in err, job.output
    assert_nothing_left(job)


@pytest.mark.parametrize("name, sig", [("sigint", signal.SIGINT), ("sigterm_spawn", signal.SIGTERM)])
def test_a_signal_to_the_supervisor_ends_every_rank(fault_jobs: Dict[str, Job], name: str, sig: int) -> None:
    job = fault_jobs[name]
    took = job.ended - job.extra["signal_at"]
    assert took < END_BOUND_S, job.output
    assert "of SIGTERM and were killed" not in "".join(job.err), job.output
    if sig == signal.SIGTERM:  # a preemption notice; its grace period (0 s here) ends: 75, "preempted, resumable"
        assert job.returncode == 75, job.output
        assert "fabriclite: preempted (SIGTERM): the ranks of node 0 did not end within the 0 s grace period" \
            in "".join(job.err), job.output
    else:
        assert job.returncode == 128 + sig, job.output
        assert f"fabriclite: stopped every rank on node 0 on {signal.Signals(sig).name}" in "".join(job.err), \
            job.output
    assert len([r for r in job.records if "helper" in r]) == 2, job.output  # each rank's child is gone too
    assert_nothing_left(job)


def test_ranks_end_when_the_supervisor_is_sigkilled(fault_jobs: Dict[str, Job]) -> None:
    job = fault_jobs["supervisor_killed"]
    assert job.returncode == -signal.SIGKILL, job.output
    # the ranks die with their parent (PR_SET_PDEATHSIG); their helpers are not the supervisor's
    # children, so only the ranks are promised: within seconds
    ranks = [r["pid"] for r in job.ranks]
    deadline = time.time() + 5
    while (left := living(ranks)) and time.time() < deadline:
        time.sleep(0.05)
    took = time.time() - job.extra["signal_at"]
    helpers = [r["helper"] for r in job.records if "helper" in r]
    kill_tree(job)
    assert not left, f"ranks left {took:.1f} s after the supervisor was killed: {left}\n{job.output}"
    assert len(helpers) == 2
