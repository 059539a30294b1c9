"""Hangs explained with live stacks (supervision/watch/stacks.py, supervision/watch/hangs.py), with real ranks: the
summary of a job stopped because of a hang shows every live rank's stacks, taken before the SIGTERM, by py-spy
and by the faulthandler handler the rank's bootstrap installs; SIGQUIT to the supervisor prints them and the job
goes on to the same weights.

The jobs of this module start together, three at a time (faults_harness.run_jobs); each test checks one.
Timeouts are short (5 s collectives, 3 s step watch) so that each job takes seconds.
"""
from __future__ import annotations

import re
import signal
import sys
import time
from typing import Dict

import pytest

from faults_harness import Job, assert_nothing_left, kill_tree, run_jobs, send
from hang_harness import hang_script, line_of

pytestmark = pytest.mark.slow

#: a job ends within this of its fault: the 5 s collective timeout (or the 3 s step watch), the stacks (py-spy
#: ~0.1 s per rank), the stop and torch's interpreter exits took up to ~15 s at load 10 on the 2-core machine;
#: x3 for a shared, loaded machine
HANG_END_BOUND_S = 45.0


def job(tmp, name: str, hang: str, **env: str) -> Job:  # type: ignore[no-untyped-def]
    kwargs = {}
    if "on_ready" in env:
        kwargs = {"on_ready": env.pop("on_ready"), "ready_ranks": 2}  # type: ignore[dict-item]
    return Job(name, [sys.executable, str(hang_script(tmp))], {"HANG": hang, "FABRICLITE_TIMEOUT": "5", **env},
               timeout=180, **kwargs)


@pytest.fixture(scope="module")
def hang_jobs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Job]:
    tmp = tmp_path_factory.mktemp("hangs")
    jobs = [
        job(tmp, "getitem_pyspy", "getitem", FABRICLITE_STACKS="py-spy"),
        job(tmp, "getitem_handler", "getitem", FABRICLITE_STACKS="handler"),
        job(tmp, "extra_collective", "extra"),
        # the step watch (3 s), not a collective timeout (30 s), ends these
        job(tmp, "deadlock_handler", "deadlock", FABRICLITE_TIMEOUT="30", FABRICLITE_HANG_TIMEOUT="3",
            FABRICLITE_STACKS="handler"),
        job(tmp, "sigquit_handler", "none", STEPS="40", STEP_SLEEP="0.1", FABRICLITE_STACKS="handler",
            on_ready=send(signal.SIGQUIT)),  # type: ignore[arg-type]
        job(tmp, "undisturbed", "none", STEPS="40"),
    ]
    started = time.time()
    try:
        run_jobs(jobs)
    except BaseException:
        for j in jobs:
            kill_tree(j)
        raise
    for j in jobs:
        print(j.summary_line())
    print(f"{len(jobs)} jobs in {time.time() - started:.1f} s")
    return {j.name: j for j in jobs}


def stacks_section(job: Job) -> str:
    err = "".join(job.err)
    assert "--- live stacks of node 0's ranks" in err, job.output
    return err[err.index("--- live stacks of node 0's ranks"):]


def rank_block(section: str, rank: int) -> str:
    """The part of the stack section under the header naming ``rank`` (alone or merged)."""
    blocks = re.split(r"\n(?=ranks? [\d, ]+:)", section)
    found = [b for b in blocks if re.match(rf"ranks? (\d+, )*{rank}(, \d+)*:", b)]
    assert found, section
    return found[0]


def assert_ended_after_fault(job: Job) -> None:
    assert job.returncode not in (0, None), job.output
    assert job.ended - job.fault_at < HANG_END_BOUND_S, job.output


@pytest.mark.parametrize("name,method", [("getitem_pyspy", "py-spy dump"), ("getitem_handler", "faulthandler")])
def test_a_rank_stuck_in_getitem_is_shown_in_that_frame(hang_jobs: Dict[str, Job], name: str, method: str) -> None:
    job = hang_jobs[name]
    assert_ended_after_fault(job)
    err = "".join(job.err)
    assert "rank 0 (local rank 0, node 0) raised RuntimeError" in err and "Timed out" in err, job.output
    section = stacks_section(job)
    # a snapshot taken just before rank 0's timeout fired (after it, gloo breaks the connections)
    assert re.search(rf"\(a rank waited [\d.]+ s on the others, 5 s is the collective timeout; all threads; {method}",
                     section), section
    first = section.split("\n")[1]
    assert first.startswith("rank 1:"), section  # the stuck rank first (rank 0 raised: its traceback is above)
    block = rank_block(section, 1)
    frame = f'hang_script.py", line {line_of("HANG-GETITEM")}, in '
    assert frame in block and "__getitem__" in block, block
    # user frames before library frames
    assert block.index("your code") < block.index("library"), block
    if method == "py-spy dump":
        assert "thread 'MainThread':" in block, block  # py-spy names threads; faulthandler cannot
    assert "in no collective; last finished broadcast #2; last optimizer step 2" in block, block
    # the stack was taken while the rank was alive: before the SIGTERM (no rank needed SIGKILL)
    assert "were killed (SIGKILL)" not in err
    assert_nothing_left(job)


def test_a_collective_the_others_never_call(hang_jobs: Dict[str, Job]) -> None:
    job = hang_jobs["extra_collective"]
    assert_ended_after_fault(job)
    err = "".join(job.err)
    # fabric.barrier() runs as an all_gather of one word (collectives/sync.py)
    assert re.search(r"raised CollectiveTimeout: fabriclite: all_gather #\d+ timed out after 5 s on rank 0: ranks \[1\] "
                     r"did not arrive", err), job.output
    block = rank_block(stacks_section(job), 1)
    assert f'hang_script.py", line {line_of("HANG-BACKWARD")}, in main' in block, block
    assert re.search(r"in backward for [\d.]+ s \(where DDP's gradient all-reduce waits for every rank\); last "
                     r"finished broadcast #2; last optimizer step 2", block), block
    assert re.search(r"rank 0 \(pid \d+\): in all_gather #3 for [\d.]+ s", stacks_section(job)), job.output
    assert_nothing_left(job)


@pytest.mark.parametrize("name", ["deadlock_handler"])
def test_a_deadlocked_thread_is_shown(hang_jobs: Dict[str, Job], name: str) -> None:
    job = hang_jobs[name]
    assert_ended_after_fault(job)
    err = "".join(job.err)
    assert "fabriclite: the job is hung: no rank of node 0 completed an optimizer step for" in err, job.output
    block = rank_block(stacks_section(job), 1)
    assert f'hang_script.py", line {line_of("HANG-THREAD")}, in ' in block, block
    # rank 0 waits in backward for rank 1's gradients: that frame is shown too
    assert f'line {line_of("HANG-BACKWARD")}, in main' in rank_block(stacks_section(job), 0)
    assert_nothing_left(job)


@pytest.mark.parametrize("name", ["sigquit_handler"])
def test_sigquit_prints_the_stacks_and_the_job_goes_on_to_the_same_weights(hang_jobs: Dict[str, Job],
                                                                         name: str) -> None:
    job, undisturbed = hang_jobs[name], hang_jobs["undisturbed"]
    assert undisturbed.returncode == 0, undisturbed.output
    assert job.returncode == 0, job.output
    section = stacks_section(job)
    assert "on request (SIGQUIT to the supervisor); the job goes on" in section, job.output
    assert 'hang_script.py", line ' in rank_block(section, 0) and "rank 1 (pid" in section, job.output
    weights = [line for line in job.out if "WEIGHTS" in line]
    expected = [line for line in undisturbed.out if "WEIGHTS" in line]
    assert weights and weights == expected, f"{weights} != {expected}\n{job.output}"
