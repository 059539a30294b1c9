"""fabriclite under a real SLURM (Debian's slurm-wlm 22.05 + munge): a 3-node cluster on this machine
(conftest.py), jobs submitted with sbatch / srun, signalled with scancel, requeued by fabriclite's real
``scontrol requeue``. The job scripts are the recipes of docs/environments.md ("Engines"), read from there.

Every scenario checks the sample accounting logged from the dataset's ``__getitem__`` (each sample of each epoch
consumed once, a failed attempt's steps counted only up to the checkpoint the next one resumed from),
``fabric.restart_count`` in every attempt, and the final weights against an uninterrupted run's where exact.

Harness speed-ups, as the engine allows them: after a requeue, ``scontrol update JobId=... StartTime=now``
(SLURM itself holds a requeued job for about 2 minutes: benchmarks/results/engines.md shows that delay as its part);
rank 0 waits at a given step of the first attempt until the test's signal arrives (WAIT_AT), so a signal lands at a
known step; only the time-limit test sleeps per step (its first attempt only), so SLURM's signal finds it running. Time bounds are generous
(each job takes 10-40 s here; the machine is shared, so every wait allows several times that).
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Dict, List, Sequence

import pytest

from slurm_jobs import TRAIN, JobFiles, accounting, attempts, check_epochs, recipe, same, substitute

SAMPLES = 60  # the dataset; batch size 4
JOB_S = 300  # a job's bound from submission to its end, on a loaded machine (they take 10-40 s)


def sbatch_recipe(cluster, files: JobFiles, devices: int, args: Sequence[str] = (), **env: str) -> str:
    """Submit docs/environments.md's sbatch recipe (its train.py and --devices substituted); the job id."""
    script = substitute(recipe("slurm-sbatch"), {" train.py": f" {TRAIN}", "--devices 2": f"--devices {devices}"})
    path = os.path.join(files.root, "job.sh")
    with open(path, "w") as f:
        f.write(script)
    return cluster.sbatch(path, [f"--output={files.root}/job-%j.out", f"--chdir={files.root}", *args],
                          files.env(**env))


def srun_line(nodes: int, tasks: int) -> str:
    """docs/environments.md's srun recipe for ``nodes`` x ``tasks``."""
    return substitute(recipe("slurm-srun").strip(), {"--nodes=3": f"--nodes={nodes}",
                                                      "--ntasks-per-node=2": f"--ntasks-per-node={tasks}",
                                                      " train.py": f" {TRAIN}"})


def sbatch_srun_recipe(cluster, files: JobFiles, nodes: int, tasks: int, args: Sequence[str] = (), **env) -> str:
    """The srun recipe as a batch job (``sbatch --wrap``), so SLURM can requeue it."""
    return cluster.sbatch(None, [f"--nodes={nodes}", f"--ntasks-per-node={tasks}", "--requeue", "--open-mode=append",
                               f"--output={files.root}/job-%j.out", f"--chdir={files.root}", *args,
                               f"--wrap={srun_line(nodes, tasks)}"], files.env(**env))


def wait_waiting(cluster, files: JobFiles, job: str, sub: str = "") -> None:
    """Wait until rank 0 waits for the signal at WAIT_AT (the job still running)."""
    cluster.wait(lambda: files.waiting(sub) or cluster.state(job) not in ("PENDING", "RUNNING"), JOB_S,
                 f"job {job} at its WAIT_AT step")
    assert files.waiting(sub), (cluster.job(job), files.output())


def finished(cluster, job: str, states: Sequence[str] = ("COMPLETED",)) -> Dict[str, str]:
    fields = cluster.wait_state(job, ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"],
                                JOB_S)
    assert fields["JobState"] in states, (fields, cluster.logs_tail())
    return fields


def requeued(cluster, job: str) -> Dict[str, str]:
    """Wait until SLURM holds the requeued job (pending again, Restarts=1), then let it start now (the harness's
    speed-up: SLURM's own delay is about 2 minutes)."""
    seen: Dict[str, str] = {}

    def held() -> bool:
        seen.clear()
        seen.update(cluster.job(job))
        return seen.get("Restarts") == "1" and seen.get("JobState") == "PENDING" or \
            seen.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT")

    cluster.wait(held, JOB_S, f"job {job} requeued")
    assert seen.get("Restarts") == "1" and seen.get("JobState") == "PENDING", (seen, cluster.logs_tail())
    cluster.start_now(job)
    return dict(seen)


def counts(files: JobFiles, sub: str = "") -> List[int]:
    return [a.restart_count for a in attempts(os.path.join(files.account, sub))]


@pytest.fixture(scope="module")
def early(cluster, tmp_path_factory):
    """Jobs submitted when the module starts, so they run alongside the tests: the uninterrupted runs every
    exactness check compares with, 3 nodes x 1 rank (the sbatch recipe, --devices 1) and 1 node x 2 ranks
    (--devices 2), and the time-limit job (most of its time is waiting for SLURM's signal)."""
    made = {}
    for name, nodes, devices in (("w3", 3, 1), ("w2", 1, 2)):
        files = JobFiles(str(tmp_path_factory.mktemp(f"reference-{name}")))
        made[name] = (files, sbatch_recipe(cluster, files, devices, [f"--nodes={nodes}"], STEPS="30"))
    files = JobFiles(str(tmp_path_factory.mktemp("time-limit")))
    made["time_limit"] = (files, sbatch_recipe(cluster, files, devices=2, args=["--nodes=1", "--time=2",
                                                                                 "--signal=USR1@60"],
                                               STEPS="30", STEP_SLEEP="3"))  # 90 s of steps: the signal finds it
    return made


@pytest.fixture(scope="module")
def references(cluster, early):
    def get(name: str):
        files, job = early[name]
        fields = finished(cluster, job)
        assert fields["ExitCode"] == "0:0", files.output()
        return files.weights()

    return get


# ---------------------------------------------------------------------------------------------- scenarios
def test_srun_3x2_and_sbatch_with_one_fabriclite_run_per_node_train_the_same(cluster, tmp_path):
    direct, per_node = JobFiles(str(tmp_path / "srun")), JobFiles(str(tmp_path / "sbatch"))
    job = sbatch_recipe(cluster, per_node, devices=2)  # 3 nodes x `fabriclite run --devices 2`: 6 ranks
    done = cluster.command(["bash", "-c", srun_line(3, 2)], direct.env(), timeout=JOB_S, cwd=direct.root)
    assert done.returncode == 0, done.stderr
    ranks = sorted(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RANK "))
    # every srun task is a rank: node rank and local rank from SLURM, world 6, nothing restarted
    assert sorted(int(r[0]) for r in ranks) == list(range(6))
    for rank, _, world, _, node, _, local, _, count in ranks:
        assert (int(world), int(node), int(local), int(count)) == (6, int(rank) // 2, int(rank) % 2, 0), ranks
    fields = finished(cluster, job)
    assert fields["ExitCode"] == "0:0" and fields["NumNodes"] == "3", fields
    out = per_node.output()
    # fabriclite run took the node count, node rank and main address from SLURM: ranks 2k, 2k+1 on node k
    for rank in range(6):
        assert f"RANK {rank} of 6 node {rank // 2} local {rank % 2} restart_count 0" in out, out
    assert "is available on your system but is not used" not in out + done.stderr  # no srun hint: a launcher chosen
    assert same(direct.weights(), per_node.weights())  # the same 6 ranks, started two ways
    for files in (direct, per_node):
        assert counts(files) == [0]
        check_epochs(accounting(files.account, 30), SAMPLES)  # 10 full epochs of 3 steps


def test_usr1_saves_requeues_and_resumes_bit_exact_and_counts_restarts(cluster, tmp_path, references):
    """``scancel -s USR1`` -> every rank saves -> node 0's supervisor runs ``scontrol requeue`` -> SLURM starts the
    job again (Restarts=1) -> it resumes; then a rank fails in the requeued allocation and `--max-restarts`
    restarts it (a fabriclite round). restart_count: 0, then 1 (SLURM's requeue), then 2 (1 requeue + round 1):
    SLURM's requeues plus this allocation's rounds (docs/reliability.md)."""
    files = JobFiles(str(tmp_path))
    job = sbatch_recipe(cluster, files, devices=1, STEPS="30", WAIT_AT="8", CRASH_AT="22:1")
    wait_waiting(cluster, files, job)
    cluster.command(["scancel", "-s", "USR1", job])
    requeued(cluster, job)
    finished(cluster, job)
    out = files.output()
    assert f"fabriclite: requeueing SLURM job {job} (scontrol requeue {job})." in out, out
    assert "CRASH at step 22" in out and "restarting every rank" in out, out
    runs = attempts(files.account)
    assert [a.restart_count for a in runs] == [0, 1, 2], runs
    assert runs[1].resumed == 8 and runs[2].resumed == 20, runs  # the USR1 save, then the step-20 checkpoint
    check_epochs(accounting(files.account, 30), SAMPLES)
    assert same(files.weights(), references("w3")), "resumed weights differ from the uninterrupted run's"


def test_the_time_limit_signal_requeues_the_job(cluster, early, references):
    """``--time=2 --signal=USR1@60``: SLURM sends USR1 60 to 90 s into the job (slurmctld checks time limits every
    30 s; the same check ends the job 30 s later at the earliest); the job saves and is requeued before its time
    limit, then finishes (its resumed attempt does not sleep: it ends before its own signal). The signal is due a
    minute in, because a signal in an attempt's first seconds reaches ranks that have not installed fabriclite's
    handler yet (imports, on a loaded machine ~20 s): SIGUSR1's default action ends them, and the job is requeued
    from its last checkpoint."""
    files, job = early["time_limit"]
    requeued(cluster, job)
    fields = finished(cluster, job)
    assert fields["Restarts"] == "1", fields
    assert f"requeueing SLURM job {job}" in files.output()
    assert counts(files) == [0, 1]
    check_epochs(accounting(files.account, 30), SAMPLES, last_full=False)
    assert same(files.weights(), references("w2"))


def test_a_job_array_task_requeues_only_itself(cluster, tmp_path):
    files = JobFiles(str(tmp_path))
    job = sbatch_recipe(cluster, files, devices=2, args=["--nodes=1", "--array=0-1"], STEPS="24", WAIT_AT="6:1")
    wait_waiting(cluster, files, f"{job}_1", sub="task1")
    cluster.command(["scancel", "-s", "USR1", f"{job}_1"])
    requeued(cluster, f"{job}_1")
    tasks = {}
    for task in (0, 1):
        tasks[task] = finished(cluster, f"{job}_{task}")
    assert tasks[0]["Restarts"] == "0" and tasks[1]["Restarts"] == "1", tasks
    assert f"fabriclite: requeueing SLURM job {job}_1 (scontrol requeue {job}_1)." in files.output()
    assert counts(files, "task0") == [0] and counts(files, "task1") == [0, 1]
    for task in ("task0", "task1"):
        check_epochs(accounting(os.path.join(files.account, task), 24), SAMPLES, last_full=False)
    assert same(files.weights("task0-weights.pt"), files.weights("task1-weights.pt"))  # resumed == uninterrupted


@pytest.fixture(scope="module")
def cancelled_3_node_job(cluster, tmp_path_factory):
    """A 3-node job cancelled with plain ``scancel`` (SIGTERM) mid-epoch: (files, job id, the step it saved)."""
    files = JobFiles(str(tmp_path_factory.mktemp("cancelled")))
    job = sbatch_recipe(cluster, files, devices=1, STEPS="30", WAIT_AT="7")
    wait_waiting(cluster, files, job)
    cluster.command(["scancel", job])
    fields = finished(cluster, job, states=("CANCELLED",))
    return files, job, fields


def test_plain_scancel_saves_and_does_not_requeue(cluster, cancelled_3_node_job):
    files, job, fields = cancelled_3_node_job
    assert fields["Restarts"] == "0", fields
    out = files.output()
    assert "preempted (SIGTERM); exit code 75 (preempted, resumable" in out, out  # the documented exit code
    assert "requeueing SLURM job" not in out
    saved = [line for line in out.splitlines() if "PREEMPTED saved at step" in line]
    assert saved, out
    step = int(saved[0].split()[-1])
    assert step == 7 and os.path.exists(os.path.join(files.ckpt, f"step-{step:04d}.ckpt"))


def test_a_job_resubmitted_on_fewer_nodes_resumes_elastically(cluster, cancelled_3_node_job):
    """The cancelled 3-node job submitted again on 2 nodes: it resumes from the same checkpoint at world size 2
    (elastic resume), finishes, and every sample of each epoch is consumed once. The remainder of the resumed
    epoch (60 - 12k samples) does not divide by 2 x 4."""
    files, first_job, _ = cancelled_3_node_job
    job = sbatch_recipe(cluster, files, devices=1, args=["--nodes=2"], STEPS="36")
    finished(cluster, job)
    runs = attempts(files.account)
    assert [(a.world, a.restart_count) for a in runs] == [(3, 0), (2, 0)], runs  # a new job: its own count
    assert runs[1].resumed == 7 and (SAMPLES - 12 * (7 % 5)) % 8 != 0, runs
    check_epochs(accounting(files.account, 36), SAMPLES, padding=1, last_full=False)
    out = files.output(job)
    assert out.count("Elastic resume:") == 1, out  # one warning, on global rank 0, naming what changed


def test_srun_ranks_requeue_after_their_configured_signal_and_not_with_auto_requeue_off(cluster, tmp_path,
                                                                                        references):
    """Ranks started by plain srun (the srun recipe, as a batch job), two jobs at once:
    ``SLURMEnvironment(requeue_signal="USR2")``: USR2 is recorded, global rank 0 requeues at exit, the job resumes
    and ends with the uninterrupted weights; ``SLURMEnvironment(auto_requeue=False)``: USR1 is recorded, every rank
    saves and exits, and the job is not requeued."""
    usr2, off = JobFiles(str(tmp_path / "usr2")), JobFiles(str(tmp_path / "off"))
    usr2_job = sbatch_srun_recipe(cluster, usr2, nodes=1, tasks=2, SLURM_ENV="requeue_signal=USR2", STEPS="30",
                                  WAIT_AT="5")
    off_job = sbatch_srun_recipe(cluster, off, nodes=1, tasks=2, SLURM_ENV="auto_requeue=0", STEPS="30",
                                 WAIT_AT="5")
    wait_waiting(cluster, usr2, usr2_job)
    cluster.command(["scancel", "-s", "USR2", usr2_job])
    wait_waiting(cluster, off, off_job)
    cluster.command(["scancel", "-s", "USR1", off_job])
    requeued(cluster, usr2_job)
    finished(cluster, usr2_job)
    assert f"fabriclite: requeueing SLURM job {usr2_job} (scontrol requeue {usr2_job})." in usr2.output()
    assert counts(usr2) == [0, 1]
    check_epochs(accounting(usr2.account, 30), SAMPLES, last_full=False)
    assert same(usr2.weights(), references("w2"))
    fields = finished(cluster, off_job)
    assert fields["Restarts"] == "0", fields
    out = off.output()
    assert "PREEMPTED saved at step 5" in out and "requeue" not in out, out
    assert counts(off) == [0] and not os.path.exists(off.out)  # saved and stopped: no final weights
