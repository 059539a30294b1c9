"""Gradient accumulation (Lightning's "Efficient gradient accumulation" guide): ``no_backward_sync`` skips
the gradient all-reduce on the accumulating micro-batches; the step after the last one syncs."""
import torch
import torch.nn.functional as F

from common import fabric_module, make_model, rank_batches, weights

Fabric = fabric_module().Fabric  # from lightning.fabric import Fabric  |  from fabriclite import Fabric

ACCUMULATE = 4


def main(workdir):
    fabric = Fabric(accelerator="cpu")
    fabric.seed_everything(9)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    model, optimizer = fabric.setup(model, optimizer)
    losses, local_grads = [], []
    for i, (x, y) in enumerate(rank_batches(fabric.global_rank, 12, seed=9)):
        is_accumulating = (i + 1) % ACCUMULATE != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = F.mse_loss(model(x), y) / ACCUMULATE
            fabric.backward(loss)
        losses.append(loss.detach())
        if is_accumulating:
            local_grads.append(model.module[0].weight.grad.clone())  # this rank's own, not yet synced
        else:
            optimizer.step()
            optimizer.zero_grad()
    return {"weights": weights(model), "losses": torch.stack(losses), "local_grads": torch.stack(local_grads)}
