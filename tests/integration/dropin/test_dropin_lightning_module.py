"""A real lightning.pytorch.LightningModule under fabriclite on 2 real ranks: setup / setup_module hook it up
as Lightning Fabric does, and its own self.log / log_dict / logger(s) / optimizers() / manual_backward /
backward / trainer / all_gather work unchanged. The weights are checked against plain torch in one process."""
from __future__ import annotations

import csv
import os

import pytest
import torch
from torch import nn



def _module_class():
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)
            self.hooks = []

        def forward(self, x):
            return self.layer(x)

        def training_step(self, batch, batch_idx):
            loss = self(batch).sum()
            self.log("loss", loss)
            self.log_dict({"a": 1.5, "b": torch.tensor(2.5)})
            self.logger.log_metrics({"direct": float(batch_idx)}, step=100 + batch_idx)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_start(self):
            self.hooks.append(("on_train_start", self.trainer.world_size, self.trainer.global_rank))

        def on_after_optimizer_step(self, strategy, optimizer):
            self.hooks.append(("on_after_optimizer_step",))

    return Net


def _train(fabric, root):
    from fabriclite import Fabric
    from fabriclite.loggers import CSVLogger

    Net = _module_class()
    rank = fabric.global_rank
    torch.manual_seed(0)
    model = Net()
    logger = CSVLogger(root, name="lm", flush_logs_every_n_steps=1)
    f = Fabric(accelerator="cpu", devices=fabric.world_size, loggers=logger)
    f.launch()
    wrapped, opt = f.setup(model, model.configure_optimizers())
    facts = {
        "fabric": model._fabric is f, "optimizers": model._fabric_optimizers == [opt],
        "self.optimizers()": model.optimizers() is opt, "callback_once": [c is model for c in f._callbacks].count(True),
        "logger": model.logger is logger, "loggers": model.loggers == [logger],
        "trainer": (model.trainer.world_size, model.trainer.global_rank, model.trainer.is_global_zero),
    }
    f.call("on_train_start")
    for step in range(2):
        batch = torch.full((2, 4), float(rank + 1 + step))
        loss = wrapped.training_step(batch, step)  # through the strategy's forward (DDP)
        opt.zero_grad()
        if step == 0:
            model.manual_backward(loss)
        else:
            model.backward(loss)
        model.optimizers().step()
    facts["gathered"] = model.all_gather(torch.tensor([float(rank), 10.0 + rank])).tolist()
    x = torch.tensor([1.0 + rank], requires_grad=True)
    (model.all_gather(x, sync_grads=True) * torch.tensor([[1.0], [3.0]])).sum().backward()
    facts["sync_grads"] = x.grad.tolist()
    # setup_module attaches the Fabric only; setup_optimizers attaches nothing
    other = Net()
    other_wrapped = f.setup_module(other)
    facts["setup_module"] = (other._fabric is f, other._fabric_optimizers,
                             [c is other for c in f._callbacks].count(True))
    f.setup_optimizers(torch.optim.SGD(other_wrapped.parameters(), lr=0.1))
    facts["setup_optimizers"] = other._fabric_optimizers
    facts["hooks"] = model.hooks
    facts["weight"] = model.layer.weight.detach().flatten().tolist() + model.layer.bias.detach().tolist()
    logger.finalize("success")
    return facts


def _reference_weights():
    """Plain torch, one process: each step's gradient is the mean of the two ranks' gradients."""
    torch.manual_seed(0)
    net = _module_class()()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(2):
        grads = []
        for rank in range(2):
            net.zero_grad()
            net(torch.full((2, 4), float(rank + 1 + step))).sum().backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for p, g0, g1 in zip(net.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    return net.layer.weight.detach().flatten().tolist() + net.layer.bias.detach().tolist()


def test_lightning_module_on_two_ranks(pool2, tmp_path):
    results = pool2.run(_train, str(tmp_path))
    reference = _reference_weights()
    for rank, facts in enumerate(results):
        assert facts["fabric"] and facts["optimizers"] and facts["self.optimizers()"]
        assert facts["callback_once"] == 1 and facts["logger"] and facts["loggers"]
        assert facts["trainer"] == (2, rank, rank == 0)
        assert facts["gathered"] == [[0.0, 10.0], [1.0, 11.0]]
        # Lightning's AllGatherGrad: every rank's loss back-propagates into each input (summed over 2 ranks)
        assert facts["sync_grads"] == [[2.0], [6.0]][rank]
        assert facts["setup_module"] == (True, [], 1) and facts["setup_optimizers"] == []
        assert facts["hooks"] == [("on_train_start", 2, rank)] + [("on_after_optimizer_step",)] * 2
        assert facts["weight"] == pytest.approx(reference, abs=1e-6)
    with open(os.path.join(tmp_path, "lm", "version_0", "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    # rank 0's values only: its loss at step 0 is sum(w . 1 + b) over a batch of 2
    assert [r["direct"] for r in rows if r["direct"]] == ["0.0", "1.0"]
    assert [(r["a"], r["b"]) for r in rows if r["a"]] == [("1.5", "2.5")] * 2
    losses = [float(r["loss"]) for r in rows if r["loss"]]
    assert len(losses) == 2
    torch.manual_seed(0)
    net = _module_class()()
    assert losses[0] == pytest.approx(net(torch.full((2, 4), 1.0)).sum().item(), abs=1e-5)
