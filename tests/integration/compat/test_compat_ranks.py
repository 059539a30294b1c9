"""The compat comparison on 3 and 4 ranks, where the order of a sum matters (test_compat.py runs on 2, where it
cannot): prog_ddp_ranks.py under Lightning Fabric and under fabriclite, each through its own CLI with
``--strategy ddp``; the weights and losses of an uninterrupted run must be bit-identical on every rank (fabriclite's
run records DDP's bucket layout at its saves: recording changes nothing torch's DDP computes)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
from helpers import free_port

from test_compat import FRAMEWORKS, JOB, differences, start

#: the four jobs (3 and 4 ranks, both frameworks) at once: measured about 100 s at a load average of 20 on 2 cores;
#: the bound is 4x that
MEASURED_S = 100
pytestmark = [pytest.mark.slow, pytest.mark.timeout(4 * MEASURED_S + 60)]
RANKS = (3, 4)


def command(framework: str, ranks: int, outdir: Path):
    port = str(free_port())
    if framework == "fabriclite":
        cli = ["-m", "fabriclite", "run", "--accelerator", "cpu", "--strategy", "ddp", "--devices", str(ranks),
               "--main-port", port]
    else:
        cli = ["-m", "lightning.fabric.cli", "--accelerator=cpu", "--strategy=ddp", f"--devices={ranks}",
               f"--main-port={port}"]
    return [sys.executable, *cli, JOB, str(outdir), "cli", "prog_ddp_ranks"]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Dict[Any, Any]:
    """``{(framework, ranks): ({rank: result}, output)}``."""
    root = tmp_path_factory.mktemp("compat_ranks")
    jobs = {(f, n): start(command(f, n, root / f"{f}-{n}"), f, root / f"{f}-{n}") for f in FRAMEWORKS for n in RANKS}
    deadline, out = time.monotonic() + 4 * MEASURED_S, {}
    started = time.monotonic()
    for (framework, ranks), proc in jobs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        outdir = root / f"{framework}-{ranks}"
        found = {r: torch.load(outdir / f"rank{r}.pt", weights_only=False)["prog_ddp_ranks"]
                 for r in range(ranks) if (outdir / f"rank{r}.pt").exists()}
        out[framework, ranks] = (found, f"exit code {proc.returncode}:\n" + (outdir / "output.txt").read_text()[-4000:])
    print(f"the four jobs: {time.monotonic() - started:.0f} s")
    return out


@pytest.mark.parametrize("ranks", RANKS)
def test_uninterrupted_ddp_is_bit_identical_to_lightning_fabric(results, ranks):
    per_framework = {}
    for framework in FRAMEWORKS:
        found, output = results[framework, ranks]
        assert sorted(found) == list(range(ranks)), f"{framework}: results from ranks {sorted(found)}; {output}"
        for rank, result in found.items():
            assert "error" not in result, f"{framework} rank {rank}: {result['error']}"
        per_framework[framework] = [found[r] for r in range(ranks)]
    ref, ours = per_framework["lightning.fabric"], per_framework["fabriclite"]
    assert ref[0]["world"] == ranks
    diffs = [d for rank, (a, b) in enumerate(zip(ref, ours)) for d in differences(a, b, f"rank{rank}")]
    assert not diffs, "Lightning Fabric vs fabriclite:\n  " + "\n  ".join(diffs[:20])
    for rank in range(1, ranks):  # DDP keeps the replicas equal
        assert not differences(ours[0]["weights"], ours[rank]["weights"])
