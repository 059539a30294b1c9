"""Loggers: CSV and TensorBoard files, written by global rank 0 only."""
from __future__ import annotations

import csv
import json
import os
from argparse import Namespace

import torch

from fabriclite import Fabric
from fabriclite.loggers import CSVLogger, Logger, TensorBoardLogger


def _log_on_every_rank(fabric, root):
    logger = CSVLogger(root, name="run", flush_logs_every_n_steps=1)
    tb = TensorBoardLogger(root, name="tb")
    ranked = Fabric(accelerator="cpu", devices=fabric.world_size, loggers=[logger, tb])
    ranked.log("loss", torch.tensor(0.5), step=0)
    ranked.log_dict({"loss": 0.25, "acc": 1.0}, step=1)
    logger.log_metrics({"direct": float(fabric.global_rank)}, step=2)  # called on every rank directly
    logger.log_hyperparams({"lr": 0.1})
    for lg in ranked.loggers:
        lg.finalize("success")
    return logger.rank, ranked.logger is logger


def test_loggers_write_on_global_rank_zero_only(pool2, tmp_path):
    assert pool2.run(_log_on_every_rank, str(tmp_path)) == [(0, True), (1, True)]
    assert os.listdir(tmp_path / "run") == ["version_0"]  # rank 1 made no directory of its own
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["loss"], r["acc"], r["direct"]) for r in rows] == [
        ("0", "0.5", "", ""), ("1", "0.25", "1.0", ""), ("2", "", "", "0.0")]
    assert json.loads((tmp_path / "run" / "version_0" / "hparams.json").read_text()) == {"lr": 0.1}
    events = os.listdir(tmp_path / "tb" / "version_0")
    assert len(events) == 1 and events[0].startswith("events.out.tfevents")


def test_csv_logger_versions_prefix_and_header_growth(tmp_path):
    first = CSVLogger(tmp_path, prefix="train", flush_logs_every_n_steps=2)
    assert first.version == 0 and first.log_dir == os.path.join(str(tmp_path), "lightning_logs", "version_0")
    first.log_metrics({"a": 1.0})
    first.log_metrics({"a": 2.0})  # step 1: flushed
    first.log_metrics({"b": torch.tensor(3.0)})
    first.finalize("success")
    with open(first.metrics_file_path) as f:
        rows = list(csv.DictReader(f))
    # the default step counts the rows since the last flush (Lightning's numbering): 0 again after the flush
    assert rows == [{"step": "0", "train-a": "1.0", "train-b": ""}, {"step": "1", "train-a": "2.0", "train-b": ""},
                    {"step": "0", "train-a": "", "train-b": "3.0"}]
    assert CSVLogger(tmp_path).version == 1
    named = CSVLogger(tmp_path, version="custom")
    named.log_hyperparams(Namespace(lr=0.1, nested={"x": 1}))
    assert json.loads((tmp_path / "lightning_logs" / "custom" / "hparams.json").read_text()) == \
        {"lr": 0.1, "nested/x": 1}


def test_tensorboard_logger_records_scalars_and_hparams(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb", version=3)
    logger.log_metrics({"loss": torch.tensor(2.0)}, step=4)
    logger.log_hyperparams({"lr": 0.1, "opt": {"name": "sgd"}})
    logger.finalize("success")
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(4, 2.0)]
    assert "hp_metric" in acc.Tags()["scalars"]


def test_tensorboard_experiment_is_a_no_op_on_other_ranks(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    logger.bind_rank(1)
    logger.log_metrics({"x": 1.0})  # a no-op
    logger.experiment.add_text("note", "on rank 1")  # Lightning's dummy experiment: accepted, does nothing
    assert not os.path.exists(tmp_path / "lightning_logs")


def test_fabric_without_loggers_and_custom_logger():
    fabric = Fabric(accelerator="cpu", devices=1)
    assert fabric.loggers == [] and fabric.logger is None
    fabric.log("x", 1.0)  # nothing to do

    class Memory(Logger):
        name, version = "memory", 0

        def __init__(self):
            super().__init__()
            self.seen = []

        def log_metrics(self, metrics, step=None):
            self.seen.append((metrics, step))

        def log_hyperparams(self, params, *args, **kwargs):
            pass

    memory = Memory()
    Fabric(accelerator="cpu", devices=1, loggers=memory).log_dict({"a": torch.tensor(1.5)}, step=7)
    assert memory.seen == [({"a": 1.5}, 7)]
