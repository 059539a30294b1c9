"""Lightning's "Communication between distributed processes" page on 2 ranks: rank_zero_first, barrier,
broadcast, all_gather and all_reduce of tensors and collections, and the strategy's own collective methods
(``fabric.strategy.all_reduce`` / ``all_gather`` / ``broadcast`` / ``reduce_boolean_decision``, which user code
and LightningModule call). Inputs are fresh tensors and floats (see docs/compat.md: Lightning reduces in place and
truncates integer means)."""
import os

import torch

from common import fabric_module

Fabric = fabric_module().Fabric  # from lightning.fabric import Fabric  |  from fabriclite import Fabric


def main(workdir):
    fabric = Fabric(accelerator="cpu")
    rank = fabric.global_rank
    marker = os.path.join(workdir, "dataset.txt")
    with fabric.rank_zero_first():
        if not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(f"downloaded by rank {rank}")
        dataset = open(marker).read()
    fabric.barrier()
    torch.manual_seed(100 + rank)  # data is different on each process
    learning_rate = torch.rand(1)
    data = torch.tensor(10 * rank)
    collection = {"loss": torch.tensor(1.5 * (rank + 1)), "data": [torch.arange(3.0) + rank, torch.ones(2, 2) * rank]}
    strategy = fabric.strategy
    return {
        "dataset": dataset,
        "broadcast": fabric.broadcast(learning_rate.clone()),
        "broadcast_src1": fabric.broadcast(learning_rate.clone(), src=1),
        "all_gather": fabric.all_gather(data.clone()),
        "all_gather_collection": fabric.all_gather({k: v for k, v in collection.items()}),
        "all_reduce_sum": fabric.all_reduce(data.clone(), reduce_op="sum"),
        "all_reduce_mean": fabric.all_reduce(learning_rate.clone(), reduce_op="mean"),
        "all_reduce_max": fabric.all_reduce(learning_rate.clone(), reduce_op="max"),
        "all_reduce_collection": fabric.all_reduce({"loss": collection["loss"].clone(),
                                                   "data": [t.clone() for t in collection["data"]]}),
        "strategy_all_reduce": strategy.all_reduce(learning_rate.clone(), reduce_op="sum"),
        "strategy_all_gather": strategy.all_gather(torch.tensor([rank, rank + 1.0])),
        "strategy_broadcast": strategy.broadcast({"from": rank, "lr": learning_rate.clone()}, src=0),
        "decision_all": strategy.reduce_boolean_decision(rank == 0, all=True),
        "decision_any": strategy.reduce_boolean_decision(rank == 0, all=False),
        "learning_rate": learning_rate,
    }
