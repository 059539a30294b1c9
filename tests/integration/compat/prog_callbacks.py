"""Callbacks (Lightning's "Callbacks" guide): plain objects passed to ``Fabric(callbacks=...)`` whose methods
are called by name with ``fabric.call``; each hook gets only the keyword arguments it declares."""
import torch

from common import fabric_module, make_model

Fabric = fabric_module().Fabric  # from lightning.fabric import Fabric  |  from fabriclite import Fabric


class Recorder:
    def __init__(self):
        self.calls = []

    def on_train_start(self):
        self.calls.append(("train_start",))

    def on_train_epoch_end(self, epoch, loss):
        self.calls.append(("epoch_end", epoch, float(loss)))

    def on_after_setup(self, fabric, module):
        self.calls.append(("after_setup", type(module).__name__.lstrip("_"), fabric.world_size))


class EpochOnly:
    def __init__(self):
        self.epochs = []

    def on_train_epoch_end(self, epoch):
        self.epochs.append(epoch)

    def on_train_end(self, **kwargs):
        self.epochs.append(sorted(kwargs))


def main(workdir):
    recorder, epoch_only = Recorder(), EpochOnly()
    fabric = Fabric(accelerator="cpu", callbacks=[recorder, epoch_only])
    fabric.seed_everything(4)
    model = fabric.setup(make_model())
    fabric.call("on_train_start")
    for epoch in range(2):
        loss = model(torch.ones(2, 8)).sum().detach() + epoch
        fabric.call("on_train_epoch_end", epoch=epoch, loss=loss)
    fabric.call("on_train_end", status="done", steps=2)
    fabric.call("a_hook_nobody_implements", value=1)
    return {"recorder": recorder.calls, "epoch_only": epoch_only.epochs}
