"""Save, load and resume (Lightning's "Saving and loading checkpoints" guide): the state dict holds the
model, the optimizer and plain values; ``fabric.load`` restores in place and returns what it did not restore."""
import os

import torch
import torch.nn.functional as F

from common import fabric_module, make_model, rank_batches, weights

Fabric = fabric_module().Fabric  # from lightning.fabric import Fabric  |  from fabriclite import Fabric


def train(fabric, model, optimizer, batches):
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def main(workdir):
    fabric = Fabric(accelerator="cpu")
    path = os.path.join(fabric.broadcast(workdir), "checkpoint.ckpt")
    batches = rank_batches(fabric.global_rank, 6, seed=6)
    fabric.seed_everything(6)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    first = train(fabric, model, optimizer, batches[:3])
    state = {"model": model, "optimizer": optimizer, "step": 3, "note": "kept"}
    fabric.save(path, state)
    continued = train(fabric, model, optimizer, batches[3:])
    continued_weights = weights(model)

    fabric.seed_everything(60)  # a different initialisation: only the checkpoint can make them agree
    model2 = make_model()
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=0.01)
    model2, optimizer2 = fabric.setup(model2, optimizer2)
    state2 = {"model": model2, "optimizer": optimizer2, "step": 0}
    remainder = fabric.load(path, state2)
    resumed = train(fabric, model2, optimizer2, batches[3:])
    full = fabric.load(path)
    return {
        "first": first,
        "continued": continued,
        "resumed": resumed,
        "weights": continued_weights,
        "resumed_weights": weights(model2),
        "step": state2["step"],
        "remainder": remainder,
        "full_keys": sorted(full),
        "full_step": full["step"],
        "optimizer_state": optimizer2.state_dict()["state"][0]["exp_avg"],
    }
