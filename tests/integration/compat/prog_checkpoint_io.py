"""A program with its own CheckpointIO plugin (Lightning's ``Fabric(plugins=[MyCheckpointIO()])``): every
checkpoint is written as gzip-compressed ``torch.save`` bytes by the plugin, and read back by it; save, load into
a fresh model, resume; ``storage_options`` reach the plugin through ``fabric.strategy.save_checkpoint``."""
import gzip
import io
import os

import torch

from common import fabric_module, make_model, rank_batches, weights
from prog_checkpoint import train

Fabric = fabric_module().Fabric  # from lightning.fabric import Fabric  |  from fabriclite import Fabric
CheckpointIO = fabric_module(".plugins.io").CheckpointIO  # from lightning.fabric.plugins.io import CheckpointIO


class GzipCheckpointIO(CheckpointIO):
    def __init__(self):
        self.calls = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.calls.append(("save", os.path.basename(path), storage_options))
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        with gzip.open(path, "wb") as f:
            f.write(buffer.getvalue())

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        self.calls.append(("load", os.path.basename(path)))
        with gzip.open(path, "rb") as f:
            return torch.load(io.BytesIO(f.read()), map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path):
        self.calls.append(("remove", os.path.basename(path)))
        os.remove(path)


def main(workdir):
    plugin = GzipCheckpointIO()
    fabric = Fabric(accelerator="cpu", plugins=[plugin])
    workdir = fabric.broadcast(workdir)
    path = os.path.join(workdir, "checkpoint.ckpt.gz")
    batches = rank_batches(fabric.global_rank, 6, seed=7)
    fabric.seed_everything(7)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    train(fabric, model, optimizer, batches[:3])
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 3})
    continued = train(fabric, model, optimizer, batches[3:])

    fabric.seed_everything(70)
    model2 = make_model()
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    model2, optimizer2 = fabric.setup(model2, optimizer2)
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    fabric.load(path, state)
    resumed = train(fabric, model2, optimizer2, batches[3:])
    fabric.strategy.save_checkpoint(os.path.join(workdir, "options.ckpt.gz"), {"step": 9},
                                    storage_options={"compresslevel": 9})
    fabric.barrier()
    with gzip.open(path, "rb") as f:  # the file the plugin wrote, as any reader would see it
        written = torch.load(io.BytesIO(f.read()), weights_only=True)
    return {
        "continued": continued,
        "resumed": resumed,
        "weights": weights(model),
        "resumed_weights": weights(model2),
        "step": state["step"],
        "calls": plugin.calls,
        "checkpoint_io_is_plugin": fabric.strategy.checkpoint_io is plugin,
        "files": sorted(os.listdir(workdir)),
        "written": written,
    }
