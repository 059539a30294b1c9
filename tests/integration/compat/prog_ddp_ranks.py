"""Plain ``ddp`` on 3 or 4 ranks (run by test_compat_ranks.py): a model whose parameters are registered in an order
unlike their use (DDP's rebuilt buckets, in gradient-ready order, differ from its first step's one bucket) and large
enough for two rebuilt buckets (the first holds 1 MiB), float32, a shuffled loader, SGD with momentum, checkpoints
after steps 1 and 4. Under fabriclite the checkpoints also hold ``fabric.resume_state()``, whose save records DDP's
bucket layout (running the rebuild pending after step 1 at the save): the weights and losses must still be Lightning
Fabric's, bit for bit, where sums of 3 and 4 numbers depend on the buckets."""
import os

import torch
import torch.nn.functional as F
from torch import nn

from common import FABRIC, fabric_module, make_dataset, weights

Fabric = fabric_module().Fabric  # from lightning.fabric import Fabric  |  from fabriclite import Fabric


class Reordered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(320, 1)
        self.embed = nn.Linear(8, 900)
        self.mid = nn.Linear(900, 320)  # 288k floats: more than the first bucket's 1 MiB

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.embed(x)))))


def main(workdir):
    fabric = Fabric(accelerator="cpu")  # devices and strategy="ddp" from the CLI
    fabric.seed_everything(7)
    model = Reordered()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(make_dataset(96), batch_size=4, shuffle=True))
    state = {"model": model, "optimizer": optimizer}
    if FABRIC == "fabriclite":
        state["resume"] = fabric.resume_state()
    losses = []
    for step, (x, y) in enumerate(loader, start=1):
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.detach())
        if step in (1, 4):
            fabric.save(os.path.join(workdir, f"step-{step}.ckpt"), state)
    return {"world": fabric.world_size, "weights": weights(model), "losses": torch.stack(losses)}
