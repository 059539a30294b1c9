"""The compat suite: Lightning-style programs (tests/integration/compat/prog_*.py, written from Lightning Fabric's documented
usage) run under Lightning Fabric and under fabriclite from the same source, with only the import swapped
(``$COMPAT_FABRIC``), each through its own CLI (``python -m lightning.fabric.cli`` / ``python -m fabriclite run``)
or its own spawn launcher; 2 CPU ranks, ddp. Their results must be bit-identical: weights, losses, logged
metric values, return values.

Eleven programs. One job per framework and launch mode runs every program of that mode (the four jobs run at
once); each test compares one program's results, rank by rank, and checks something about them that does not
depend on the other framework (ranks agree after a sync, a resumed run matches the uninterrupted one, ...).
"""
from __future__ import annotations

import math
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from helpers import free_port

#: the first test waits for the four jobs (about 2 minutes at a load average of 20 on 2 cores)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent
JOB = str(HERE / "job.py")
FRAMEWORKS = ("lightning.fabric", "fabriclite")
CLI_PROGRAMS = ["prog_cli_script", "prog_lightning_module", "prog_loggers", "prog_torchmetrics", "prog_callbacks",
                "prog_checkpoint", "prog_checkpoint_io", "prog_grad_accum", "prog_collectives"]
SPAWN_PROGRAMS = ["prog_launch_spawn", "prog_run_subclass"]
JOB_TIMEOUT = 480


def cli_command(framework: str, outdir: Path) -> List[str]:
    port = str(free_port())  # Lightning's CLI defaults to 29400, which parallel runs would share
    if framework == "fabriclite":
        cli = ["-m", "fabriclite", "run", "--accelerator", "cpu", "--strategy", "ddp", "--devices", "2",
               "--main-port", port]
    else:
        cli = ["-m", "lightning.fabric.cli", "--accelerator=cpu", "--strategy=ddp", "--devices=2",
               f"--main-port={port}"]
    return [sys.executable, *cli, JOB, str(outdir), "cli", *CLI_PROGRAMS]


def start(command: List[str], framework: str, outdir: Path) -> subprocess.Popen:
    outdir.mkdir(parents=True)
    env = {**os.environ, "COMPAT_FABRIC": framework, "OMP_NUM_THREADS": "1", "FABRICLITE_TIMEOUT": "120",
           "PYTHONUNBUFFERED": "1"}
    for var in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "PL_GLOBAL_SEED"):
        env.pop(var, None)
    return subprocess.Popen(command, env=env, cwd=str(outdir), stdout=open(outdir / "output.txt", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Dict[str, Any]]:
    """``{framework: {"cli": {rank: {program: result}}, "spawn": {program: result}, "output": text}}``."""
    root = tmp_path_factory.mktemp("compat")
    jobs = {}
    for framework in FRAMEWORKS:
        jobs[framework, "cli"] = start(cli_command(framework, root / framework / "cli"), framework,
                                       root / framework / "cli")
        spawn_dir = root / framework / "spawn"
        jobs[framework, "spawn"] = start([sys.executable, JOB, str(spawn_dir), "spawn", *SPAWN_PROGRAMS], framework,
                                         spawn_dir)
    out: Dict[str, Dict[str, Any]] = {f: {"output": ""} for f in FRAMEWORKS}
    deadline = time.monotonic() + JOB_TIMEOUT  # one deadline for the four jobs running at once
    for (framework, mode), proc in jobs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        outdir = root / framework / mode
        out[framework]["output"] += f"--- {mode} job, exit code {proc.returncode}:\n" + \
            (outdir / "output.txt").read_text()[-6000:]
        if mode == "cli":
            out[framework]["cli"] = {r: torch.load(outdir / f"rank{r}.pt", weights_only=False)
                                     for r in (0, 1) if (outdir / f"rank{r}.pt").exists()}
        else:
            path = outdir / "spawn.pt"
            out[framework]["spawn"] = torch.load(path, weights_only=False) if path.exists() else {}
    return out


# ---------------------------------------------------------------------------------------------- comparing
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def differences(a: Any, b: Any, path: str = "") -> List[str]:
    """Where ``a`` and ``b`` differ, down to the bits of every tensor and float."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        same = torch.equal(_bytes(a), _bytes(b)) if a.numel() else True
        return [] if same else [f"{path}: tensors differ (max abs diff {(a.double() - b.double()).abs().max()})"]
    if isinstance(a, dict):
        if list(a) != list(b) and sorted(map(str, a)) != sorted(map(str, b)):
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float):
        return [] if struct.pack("<d", a) == struct.pack("<d", b) else [f"{path}: {a!r} vs {b!r}"]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def program_results(results: Dict[str, Dict[str, Any]], mode: str, program: str) -> Dict[str, List[Any]]:
    """``{framework: [result per rank]}`` (one entry for spawn jobs: rank 0's return value); fails with the
    program's traceback or the job's output when a run did not produce it."""
    found = {}
    for framework in FRAMEWORKS:
        per_rank = ([results[framework]["cli"].get(r, {}).get(program) for r in (0, 1)] if mode == "cli"
                    else [results[framework]["spawn"].get(program)])
        for rank, result in enumerate(per_rank):
            if result is None:
                pytest.fail(f"{framework}: no result from {program} (rank {rank}); job output:\n"
                            f"{results[framework]['output']}")
            if "error" in result:
                pytest.fail(f"{framework}: {program} raised on rank {rank}:\n{result['error']}")
        found[framework] = per_rank
    return found


def assert_identical(results: Dict[str, Dict[str, Any]], mode: str, program: str) -> List[Any]:
    """The program's results are bit-identical under both frameworks; returns Lightning's, per rank."""
    found = program_results(results, mode, program)
    ref, ours = found["lightning.fabric"], found["fabriclite"]
    diffs = [d for rank, (a, b) in enumerate(zip(ref, ours)) for d in differences(a, b, f"rank{rank}")]
    assert not diffs, f"{program}: Lightning Fabric vs fabriclite:\n  " + "\n  ".join(diffs[:20])
    return ref


def same_on_both_ranks(per_rank: List[Any], key: str) -> None:
    assert not differences(per_rank[0][key], per_rank[1][key]), f"{key} differs between the ranks"


# ---------------------------------------------------------------------------------------------- the programs
def test_cli_script_without_launch(results):
    ranks = assert_identical(results, "cli", "prog_cli_script")
    assert [r["facts"][:5] for r in ranks] == [(2, 0, 0, 0, True), (2, 1, 1, 0, False)]
    same_on_both_ranks(ranks, "weights")
    same_on_both_ranks(ranks, "losses")
    assert not torch.equal(ranks[0]["seen"], ranks[1]["seen"])  # each rank trained on its own shard
    assert torch.equal(ranks[0]["gathered"], torch.tensor([[0.0, 1.0], [10.0, 1.0]]))
    assert torch.equal(ranks[0]["broadcast"], torch.tensor([1, 2, 3]))
    assert ranks[1]["sum"].item() == 3.0


def test_lightning_module(results):
    ranks = assert_identical(results, "cli", "prog_lightning_module")
    same_on_both_ranks(ranks, "weights")
    logged = ranks[0]["logged"]
    assert len(logged) == 2 * 2 * 4 and ranks[1]["logged"] == []  # 2 epochs x 4 batches x (log + log_dict)
    assert logged[0][1]["train_loss"] == ranks[0]["losses"][0].item()
    assert ranks[0]["gathered"].shape == (8, 2)
    assert ranks[0]["hooks"] == [("on_train_epoch_start", 0), ("on_train_epoch_end", 0)] * 2
    assert ranks[0]["logger_is_fabric_logger"] and ranks[1]["trainer_rank"] == 1


def test_loggers_on_every_rank(results):
    ranks = assert_identical(results, "cli", "prog_loggers")
    same_on_both_ranks(ranks, "facts")
    lines = ranks[0]["metrics_csv"].splitlines()
    assert len(lines) == 4 and "0.5" in lines[1]
    assert ranks[1]["metrics_csv"] is None


def test_torchmetrics_sync_through_the_group(results):
    ranks = assert_identical(results, "cli", "prog_torchmetrics")
    for key in ("accuracy", "mean", "total", "per_step"):
        same_on_both_ranks(ranks, key)  # synced: both ranks see the metric over both ranks' data
    assert ranks[0]["world"] == 2


def test_callbacks_with_fabric_call(results):
    ranks = assert_identical(results, "cli", "prog_callbacks")
    calls = ranks[0]["recorder"]
    assert calls[0][0] == "after_setup" and calls[1] == ("train_start",)
    assert [c[:2] for c in calls[2:]] == [("epoch_end", 0), ("epoch_end", 1)]
    assert ranks[0]["epoch_only"] == [0, 1, ["status", "steps"]]


def test_save_load_resume(results):
    ranks = assert_identical(results, "cli", "prog_checkpoint")
    for r in ranks:
        assert torch.equal(r["resumed"], r["continued"])  # the resumed run repeats the uninterrupted one
        assert not differences(r["resumed_weights"], r["weights"])
        assert r["step"] == 3 and r["remainder"] == {"note": "kept"}
        assert r["full_keys"] == ["model", "note", "optimizer", "step"]


def test_a_programs_own_checkpoint_io_writes_and_reads_every_checkpoint(results):
    ranks = assert_identical(results, "cli", "prog_checkpoint_io")
    for rank, r in enumerate(ranks):
        assert torch.equal(r["resumed"], r["continued"]) and not differences(r["resumed_weights"], r["weights"])
        assert r["step"] == 3 and r["checkpoint_io_is_plugin"]
        assert r["files"] == ["checkpoint.ckpt.gz", "options.ckpt.gz"]
        assert sorted(r["written"]) == ["model", "optimizer", "step"] and r["written"]["step"] == 3
        saves = [("save", "checkpoint.ckpt.gz", None), ("save", "options.ckpt.gz", {"compresslevel": 9})]
        assert r["calls"] == (saves[:1] if rank == 0 else []) + [("load", "checkpoint.ckpt.gz")] + \
            (saves[1:] if rank == 0 else [])  # global rank 0 writes, every rank reads


def test_gradient_accumulation_no_backward_sync(results):
    ranks = assert_identical(results, "cli", "prog_grad_accum")
    same_on_both_ranks(ranks, "weights")
    assert not torch.equal(ranks[0]["local_grads"], ranks[1]["local_grads"])  # not synced while accumulating


def test_collectives_page(results):
    ranks = assert_identical(results, "cli", "prog_collectives")
    lr0, lr1 = ranks[0]["learning_rate"], ranks[1]["learning_rate"]
    assert not torch.equal(lr0, lr1)  # the data differed: the collectives below had something to do
    for r in ranks:
        assert r["dataset"] == "downloaded by rank 0"
        assert torch.equal(r["broadcast"], lr0) and torch.equal(r["broadcast_src1"], lr1)
        assert torch.equal(r["all_gather"], torch.tensor([0, 10])) and r["all_reduce_sum"].item() == 10
        assert torch.equal(r["all_reduce_max"], torch.maximum(lr0, lr1))
        assert torch.equal(r["strategy_all_reduce"], lr0 + lr1)
        assert r["strategy_broadcast"]["from"] == 0 and (r["decision_all"], r["decision_any"]) == (False, True)
        assert torch.equal(r["strategy_all_gather"], torch.tensor([[0.0, 1.0], [1.0, 2.0]]))
    same_on_both_ranks(ranks, "all_reduce_collection")


def test_launch_spawn_returns_rank_zero_result(results):
    (result,) = assert_identical(results, "spawn", "prog_launch_spawn")
    assert result["rank"] == 0 and result["world"] == 2
    assert result["ranks"] == ("torch.int64", [0, 1])
    assert result["weights"]["0.weight"][0] == "torch.float32"


def test_run_subclass(results):
    (result,) = assert_identical(results, "spawn", "prog_run_subclass")
    assert result["rank"] == 0 and result["sum"] == ("torch.float32", 3.0)


def test_differences_finds_single_bit_flips():
    """The comparison can fail: a one-ulp change, a -0.0, a dtype, a missing key."""
    a = {"w": torch.tensor([1.0, 2.0]), "x": 0.1, "l": [1, (2, 3)]}
    b = {"w": torch.nextafter(torch.tensor([1.0, 2.0]), torch.tensor(3.0)), "x": 0.1, "l": [1, (2, 3)]}
    assert differences(a, a) == [] and len(differences(a, b)) == 1
    assert differences(0.0, -0.0) and differences(math.nan, math.nan) == []
    assert differences(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert differences({"a": 1}, {"b": 1})
