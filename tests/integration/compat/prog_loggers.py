"""Loggers used on every rank, as scripts written for Lightning do: every rank reads the logger's name,
version and directories and calls its experiment (non-zero ranks get a no-op experiment); metrics and
hyperparameters are written by rank 0 only."""
import os

import torch

from common import fabric_module

Fabric = fabric_module().Fabric  # from lightning.fabric import Fabric  |  from fabriclite import Fabric
loggers = fabric_module(".loggers")  # from lightning.fabric import loggers  |  from fabriclite import loggers


def main(workdir):
    csv = loggers.CSVLogger(root_dir=os.path.join(workdir, "csv"), name="exp")
    tb = loggers.TensorBoardLogger(root_dir=os.path.join(workdir, "tb"), name="exp")
    fabric = Fabric(accelerator="cpu", loggers=[csv, tb])
    rel = lambda p: os.path.relpath(p, workdir)  # noqa: E731
    facts = {"csv": (csv.name, csv.version, rel(csv.root_dir), rel(csv.log_dir)),
             "tb": (tb.name, tb.version, rel(tb.root_dir), rel(tb.log_dir)),
             "first_is_csv": fabric.logger is csv, "count": len(fabric.loggers)}
    tb.experiment.add_text("note", f"hello from rank {fabric.global_rank}", 0)  # every rank
    tb.experiment.add_scalar("direct", 1.0 + fabric.global_rank, 0)
    fabric.log("loss", torch.tensor(0.5), step=0)
    fabric.log_dict({"acc": 0.25, "lr": torch.tensor(0.125)}, step=1)
    fabric.log_dict({"acc": 0.75}, step=2)
    tb.log_hyperparams({"lr": 0.125, "layers": 2})
    fabric.barrier()
    for logger in fabric.loggers:
        logger.finalize("success")
    fabric.barrier()
    files = sorted(os.path.relpath(os.path.join(d, f), workdir) for d, _, fs in os.walk(workdir) for f in fs
                   if "events.out.tfevents" not in f)
    events = sum("events.out.tfevents" in f for _, _, fs in os.walk(workdir) for f in fs)
    metrics_csv = os.path.join(csv.log_dir, "metrics.csv")
    return {
        "facts": facts,
        "files": files,
        "event_files": events,
        "metrics_csv": open(metrics_csv).read() if fabric.is_global_zero else None,
    }
