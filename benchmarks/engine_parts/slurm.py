"""SLURM's recovery, in parts: a real 3-node cluster on this machine (tests/support/slurm_cluster.py), the lane's
training job (tests/integration/engines/lane_slurm/slurm_train.py) submitted with docs/environments.md's sbatch
recipe (3 nodes x `fabriclite run --devices 1`), ``scancel -s USR1`` at step 8, then:

- signal -> saved: ``scancel`` returned -> rank 0's preemption save done (every rank saved). The job waits at
  step 8 for the signal (WAIT_AT), so its ``check_preempted()`` runs at once: this is the agreement and the save,
  not the wait for a loop's next check (up to one step in a real loop);
- saved -> requeued: -> SLURM shows the job pending again with Restarts=1 (the ranks exited, node 0's supervisor
  ran ``scontrol requeue``, SLURM took the job back);
- requeued -> started (SLURM's own delay): -> SLURM runs the job again. Nothing speeds it up here: this is the
  begin time SLURM gives a requeued job (the lane's tests skip it with ``scontrol update StartTime=now``);
- started -> training again: -> the new attempt's first step done (processes, imports, rendezvous, load_latest).

Times come from polling ``scontrol show job`` every 0.25 s and from the job's own event log (rank 0's wall
clock, the same machine).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Dict, List, Optional

_SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests",
                        "support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)

PARTS = ("signal -> saved", "saved -> requeued", "requeued -> started (SLURM's own delay)",
         "started -> training again")


def available() -> Optional[str]:
    """None when a SLURM cluster can be started here, else why not (one line)."""
    if os.geteuid() != 0:
        return "needs root (slurmctld / slurmd run as root; scripts/engines/slurm.sh installs SLURM)"
    from slurm_cluster import missing_tools

    missing = missing_tools()
    return f"SLURM not installed (missing {', '.join(missing)}): run scripts/engines/slurm.sh" if missing else None


def _events(path: str) -> List[List[str]]:
    with open(path) as f:
        return [line.split() for line in f if line.strip()]


def _one(cluster, root: str) -> Dict[str, float]:
    from slurm_jobs import TRAIN, JobFiles, recipe, substitute

    files = JobFiles(root)
    script = substitute(recipe("slurm-sbatch"), {" train.py": f" {TRAIN}", "--devices 2": "--devices 1"})
    path = os.path.join(root, "job.sh")
    with open(path, "w") as f:
        f.write(script)
    job = cluster.sbatch(path, [f"--output={root}/job-%j.out", f"--chdir={root}"],
                         files.env(STEPS="30", WAIT_AT="8"))
    cluster.wait(lambda: files.waiting() or cluster.state(job) not in ("PENDING", "RUNNING"), 300, "step 8")
    cluster.command(["scancel", "-s", "USR1", job])
    signalled = time.time()
    requeued = started = None
    deadline = time.monotonic() + 600
    while started is None and time.monotonic() < deadline:
        fields = cluster.job(job)
        now = time.time()
        if requeued is None and fields.get("Restarts") == "1" and fields.get("JobState") == "PENDING":
            requeued = now
        if requeued is not None and fields.get("JobState") == "RUNNING":
            started = now
        time.sleep(0.25)
    if requeued is None or started is None:
        raise RuntimeError(f"job {job} was not requeued and started again within 600 s: {cluster.job(job)}")
    cluster.wait_state(job, ["COMPLETED"], 300)
    events = _events(os.path.join(files.account, "events.log"))
    saved = next(float(t) for name, t, *_ in events if name == "saved")
    again = [float(t) for name, t, attempt in events if name == "first_step" and attempt.split("-")[1] == "1"][0]
    return {PARTS[0]: saved - signalled, PARTS[1]: requeued - saved, PARTS[2]: started - requeued,
            PARTS[3]: again - started}


def measure(repeats: int) -> Dict[str, List[float]]:
    """The parts of ``repeats`` requeues, in order (see the module docstring); each takes SLURM's ~2 minutes."""
    from slurm_cluster import SlurmCluster

    results: Dict[str, List[float]] = {part: [] for part in PARTS}
    with tempfile.TemporaryDirectory(prefix="fabriclite-bench-slurm-") as tmp:
        os.chmod(tmp, 0o755)
        with SlurmCluster(os.path.join(tmp, "cluster")) as cluster:
            for i in range(repeats):
                for part, value in _one(cluster, os.path.join(tmp, f"run{i}")).items():
                    results[part].append(value)
    return results
