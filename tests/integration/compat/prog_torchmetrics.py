"""torchmetrics metrics updated on each rank with its own data and synced through Fabric's process group on
``compute()`` (Lightning's docs: "use torchmetrics with Fabric")."""
import torch
import torchmetrics

from common import fabric_module

Fabric = fabric_module().Fabric  # from lightning.fabric import Fabric  |  from fabriclite import Fabric


def main(workdir):
    fabric = Fabric(accelerator="cpu")
    accuracy = torchmetrics.classification.BinaryAccuracy().to(fabric.device)
    mean = torchmetrics.MeanMetric().to(fabric.device)
    total = torchmetrics.SumMetric().to(fabric.device)
    g = torch.Generator().manual_seed(40 + fabric.global_rank)
    per_step = []
    for step in range(3):
        preds = torch.rand(16, generator=g)
        target = (torch.rand(16, generator=g) > 0.4).int()
        accuracy.update(preds, target)
        mean.update(preds)
        total.update(target.sum())
        per_step.append(accuracy.compute())  # synced across the ranks
    return {
        "accuracy": accuracy.compute(),
        "mean": mean.compute(),
        "total": total.compute(),
        "per_step": torch.stack(per_step),
        "world": fabric.world_size,
    }
