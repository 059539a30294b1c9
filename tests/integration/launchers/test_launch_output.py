"""Per-rank output: every line of a rank's stdout and stderr can carry ``[rank N]`` and be kept in
``LOG_DIR/rank_N.log`` (``fabriclite run --rank-prefix --log-dir``; $FABRICLITE_RANK_PREFIX and
$FABRICLITE_LOG_DIR in script and spawn mode). Here rank 1 also raises, so the failure's traceback
must reach its log file, and the supervisor's summary must come after every rank's lines."""
from __future__ import annotations

import sys
import textwrap
from typing import Dict

import pytest

from faults_harness import Job, assert_nothing_left, run_jobs

pytestmark = pytest.mark.slow

SCRIPT = r'''
import json, os, sys, time

MODE = os.environ.get("MODE", "script")


def work(fabric):
    rank = fabric.global_rank
    os.write(1, ("FAULT " + json.dumps({"rank": rank, "pid": os.getpid(), "pgid": os.getpgid(0)}) + "\n").encode())
    print(f"hello from rank {rank}")
    print(f"warning from rank {rank}", file=sys.stderr)
    os.write(1, f"raw write from rank {rank}\n".encode())  # below Python's sys.stdout
    fabric.barrier()
    if rank == 1:
        raise ValueError("rank 1 fails after printing")
    fabric.barrier()


if __name__ == "__main__":
    from fabriclite import Fabric

    if os.environ.get("UNDER_CLI"):
        fabric = Fabric()
    else:
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp" if MODE == "script" else "ddp_spawn")
    if MODE == "script":
        fabric.launch()
        work(fabric)
    else:
        fabric.launch(work)
'''


@pytest.fixture(scope="module")
def output_jobs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Job]:
    tmp = tmp_path_factory.mktemp("output")
    script = tmp / "output_script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    jobs = [
        Job("cli", [sys.executable, "-m", "fabriclite", "run", "--accelerator", "cpu", "--devices", "2",
                    "--rank-prefix", "--log-dir", str(tmp / "cli_logs"), str(script)], {"UNDER_CLI": "1"}),
        Job("script", [sys.executable, str(script)],
            {"FABRICLITE_RANK_PREFIX": "1", "FABRICLITE_LOG_DIR": str(tmp / "script_logs")}),
        Job("spawn", [sys.executable, str(script)],
            {"MODE": "spawn", "FABRICLITE_RANK_PREFIX": "1", "FABRICLITE_LOG_DIR": str(tmp / "spawn_logs")}),
    ]
    run_jobs(jobs)
    for job in jobs:
        job.extra_logs = tmp / f"{job.name}_logs"  # type: ignore[attr-defined]
    return {job.name: job for job in jobs}


@pytest.mark.parametrize("name", ["cli", "script", "spawn"])
def test_rank_prefix_and_log_files(output_jobs: Dict[str, Job], name: str) -> None:
    job = output_jobs[name]
    out, err = "".join(job.out), "".join(job.err)
    assert job.returncode == 1, job.output
    for rank in (0, 1):
        assert f"[rank {rank}] hello from rank {rank}\n" in out, job.output
        assert f"[rank {rank}] raw write from rank {rank}\n" in out, job.output
        assert f"[rank {rank}] warning from rank {rank}\n" in err, job.output
        log = (job.extra_logs / f"rank_{rank}.log").read_text()  # type: ignore[attr-defined]
        for line in (f"hello from rank {rank}", f"warning from rank {rank}", f"raw write from rank {rank}"):
            assert line + "\n" in log, log
        assert "[rank " not in log and "[rank1]" not in log, log  # the rank's own lines, no prefix
    assert "[rank 1] ValueError: rank 1 fails after printing" in err, job.output
    assert "ValueError: rank 1 fails after printing" in (job.extra_logs / "rank_1.log").read_text()  # type: ignore[attr-defined]
    # every line of the ranks is out before the summary, which is not prefixed
    summary_at = err.index("fabriclite: the job failed: rank 1 (local rank 1, node 0) raised ValueError")
    assert "[rank " not in err[summary_at:], job.output
    assert_nothing_left(job)
