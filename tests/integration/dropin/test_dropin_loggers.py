"""Loggers used on every rank (2 real ranks): rank 1's experiment is a no-op object, name / version / root_dir /
log_dir equal rank 0's on every rank, only rank 0 writes, and a logger without a Fabric takes its rank from
the environment (checked against Lightning's own rank lookup)."""
from __future__ import annotations

import csv
import os

import pytest
import torch

from fabriclite import Fabric
from fabriclite.loggers import CSVLogger, TensorBoardLogger
from fabriclite.loggers.base import DummyExperiment


def _every_rank(fabric, root):
    rank = fabric.global_rank
    # rank 0 makes version_0 exist first: a rank choosing its own "next free version" afterwards would pick 1
    early = CSVLogger(root, name="csv")
    if rank == 0:
        early.log_metrics({"warmup": 1.0}, step=0)
        early.save()
    fabric.barrier()
    csv_logger = CSVLogger(root, name="csv", flush_logs_every_n_steps=1)
    tb = TensorBoardLogger(root, name="tb")
    if rank == 0:
        tb.log_metrics({"x": 0.0}, step=0)  # rank 0 creates tb/version_0 before rank 1 looks
    fabric.barrier()
    ranked = Fabric(accelerator="cpu", devices=fabric.world_size, loggers=[csv_logger, tb])
    ranked.launch()
    # Lightning's dummy experiment on rank 1: any attribute, call, item and chain
    out = tb.experiment.add_text("note", f"rank {rank}")
    chained = tb.experiment.some.deeply.nested.call(1, k=2)[0].more() if rank else None
    if rank:
        with csv_logger.experiment as exp:
            exp.anything()[1] = 2
    csv_logger.log_metrics({"value": float(rank + 1)}, step=rank)  # on every rank; only rank 0 writes
    csv_logger.log_hyperparams({"lr": 0.1 * (rank + 1)})
    ranked.log("via_fabric", torch.tensor(2.5), step=5)
    for logger in ranked.loggers:
        logger.finalize("success")
    fabric.barrier()
    alone_version = CSVLogger(root, name="csv").version  # never given to a Fabric: looks for itself, late
    facts = {
        name: (lg.name, lg.version, lg.root_dir, lg.log_dir) for name, lg in (("csv", csv_logger), ("tb", tb))
    }
    dummies = [isinstance(x, DummyExperiment) for x in (tb.experiment, csv_logger.experiment, out)]
    dummies.append(chained is None if rank == 0 else isinstance(chained, DummyExperiment))
    return facts, dummies, alone_version, early.version


def test_loggers_on_every_rank(pool2, tmp_path):
    root = str(tmp_path)
    (f0, d0, alone0, early0), (f1, d1, alone1, early1) = pool2.run(_every_rank, root)
    assert f1 == f0  # name, version, root_dir, log_dir agree with rank 0's
    assert f0["csv"][1] == 1 and f0["tb"][1] == 0
    assert f0["csv"][3] == os.path.join(root, "csv", "version_1")
    assert alone1 == 2 != f1["csv"][1]  # what agreeing prevents: rank 1 choosing after rank 0 created version_1
    assert d0 == [False, False, False, True] and d1 == [True, True, True, True]
    with open(os.path.join(root, "csv", "version_1", "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["value"]) for r in rows if r.get("value")] == [("0", "1.0")]  # rank 0's row only
    assert [(r["step"], r["via_fabric"]) for r in rows if r.get("via_fabric")] == [("5", "2.5")]
    with open(os.path.join(root, "csv", "version_1", "hparams.json")) as f:
        assert '"lr": 0.1' in f.read()
    assert sorted(os.listdir(os.path.join(root, "csv"))) == ["version_0", "version_1"]
    assert sorted(os.listdir(os.path.join(root, "tb"))) == ["version_0"]


@pytest.mark.parametrize("env,rank", [
    ({}, 0), ({"RANK": "1"}, 1), ({"LOCAL_RANK": "2"}, 2), ({"SLURM_PROCID": "3"}, 3),
    ({"RANK": "0", "SLURM_PROCID": "5"}, 0), ({"LOCAL_RANK": "1", "SLURM_PROCID": "0"}, 1),
    ({"JSM_NAMESPACE_RANK": "4"}, 4),
])
def test_logger_without_fabric_takes_its_rank_from_the_environment(monkeypatch, tmp_path, env, rank):
    from lightning.fabric.utilities.rank_zero import _get_rank

    for name in ("FABRICLITE_RANK", "RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert (_get_rank() or 0) == rank  # Lightning's rule, the reference
    logger = CSVLogger(tmp_path, name="env", flush_logs_every_n_steps=1)
    assert logger.rank == rank
    logger.log_metrics({"a": 1.0}, step=0)
    logger.log_hyperparams({"b": 2})
    logger.finalize("success")
    assert os.path.exists(tmp_path / "env") == (rank == 0)
    assert isinstance(logger.experiment, DummyExperiment) == (rank != 0)
