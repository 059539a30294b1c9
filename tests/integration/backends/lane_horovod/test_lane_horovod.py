"""Horovod lane: fabriclite's HorovodStrategy under a real ``horovodrun --gloo`` (horovod 0.28.1 built for torch
2.13.0 CPU; `make env-horovod`). Each job starts once per module; the checks are read back per rank."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import checks  # noqa: E402

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "job.py")
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")


def horovodrun(np: int, mode: str, out: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [HOROVODRUN, "-np", str(np), "-H", f"localhost:{np}", "--gloo", sys.executable, JOB, mode, out]
    env = {**os.environ, "FABRICLITE_EXPECT_WORLD": str(np)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def results(out: str, world: int) -> List[Dict[str, str]]:
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]


def assert_ok(found: List[Dict[str, str]], name: str) -> None:
    for rank, res in enumerate(found):
        assert res.get(name) == "ok", f"rank {rank}, {name}:\n{res.get(name, 'not run')}"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Tuple[str, List[Dict[str, str]]]:
    out = str(tmp_path_factory.mktemp("horovod"))
    proc = horovodrun(2, "checks", out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out, results(out, 2)


@pytest.mark.parametrize("name", [*checks.ALL, "horovod_internals"])
def test_check_on_two_ranks(two_ranks: Tuple[str, List[Dict[str, str]]], name: str) -> None:
    assert_ok(two_ranks[1], name)


def test_same_weights_as_ddp(two_ranks: Tuple[str, List[Dict[str, str]]]) -> None:
    out = two_ranks[0]
    proc = subprocess.run([sys.executable, JOB, "ddp", out], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "FABRICLITE_EXPECT_WORLD": "2"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert_ok(results(os.path.join(out, "ddp"), 2), "training_parity")
    horovod = torch.load(os.path.join(out, "params-horovod.pt"))
    ddp = torch.load(os.path.join(out, "ddp", "params-ddp.pt"))
    assert len(horovod) == len(ddp) == 4
    for h, d in zip(horovod, ddp):
        assert torch.allclose(h, d, atol=1e-6), (h, d)


def test_process_sets_on_three_ranks(tmp_path: "os.PathLike[str]") -> None:
    out = str(tmp_path)
    proc = horovodrun(3, "groups", out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    found = results(out, 3)
    for name in ("process_set_groups", "all_reduce_nested", "all_gather_uneven_cat"):
        assert_ok(found, name)


def test_a_failing_rank_ends_the_job(tmp_path: "os.PathLike[str]") -> None:
    proc = horovodrun(2, "fail", str(tmp_path), timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert "Traceback" in output and "rank 1 fails on purpose" in output, output[-4000:]
