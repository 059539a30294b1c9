"""``launch(fn)`` with the spawn strategy (Lightning's "Launch distributed training" guide, for notebooks and
scripts that set devices in code): ``fn(fabric, *args)`` runs in each new process, rank 0's result comes back."""
import torch
import torch.nn.functional as F

from common import fabric_module, make_model, plain, rank_batches, weights

Fabric = fabric_module().Fabric  # from lightning.fabric import Fabric  |  from fabriclite import Fabric


def train(fabric, steps, lr):
    fabric.seed_everything(7)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for x, y in rank_batches(fabric.global_rank, steps, seed=7):
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(fabric.all_reduce(loss.detach()))
    return plain({"rank": fabric.global_rank, "world": fabric.world_size, "weights": weights(model),
                  "losses": torch.stack(losses), "ranks": fabric.all_gather(torch.tensor(fabric.global_rank))})


def main(workdir):
    fabric = Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2)
    return fabric.launch(train, 4, lr=0.1)
