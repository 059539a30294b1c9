"""A script launched by the CLI (``fabric run`` / ``fabriclite run``) that never calls ``launch()``: Fabric
joins the job in ``__init__``, takes devices and strategy from the CLI, and trains with a sharded loader."""
import torch
import torch.nn.functional as F

from common import fabric_module, make_dataset, make_model, weights

Fabric = fabric_module().Fabric  # from lightning.fabric import Fabric  |  from fabriclite import Fabric


def main(workdir):
    fabric = Fabric(accelerator="cpu")  # devices, strategy, num_nodes: from the CLI; no fabric.launch()
    fabric.seed_everything(1)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(make_dataset(), batch_size=8, shuffle=True))
    losses, seen = [], []
    for epoch in range(2):
        for x, y in loader:
            seen.append(x[:, 0].clone())
            loss = F.mse_loss(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean"))
    fabric.barrier()
    return {
        "facts": (fabric.world_size, fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.is_global_zero,
                  str(fabric.device), len(loader)),
        "weights": weights(model),
        "losses": torch.stack(losses),
        "seen": torch.cat(seen),
        "gathered": fabric.all_gather(torch.tensor([fabric.global_rank * 10.0, 1.0])),
        "broadcast": fabric.broadcast(torch.arange(3) + fabric.global_rank, src=1),
        "sum": fabric.all_reduce(torch.tensor([fabric.global_rank + 1.0]), reduce_op="sum"),
    }
