"""The demo: two CPU ranks, each printing its facts, then one nested all_reduce.

    python examples/demo.py            # or: make demo
    fabriclite run --devices 2 examples/demo.py
"""
import torch

from fabriclite import Fabric

fabric = Fabric(accelerator="cpu", devices=2)
fabric.launch()  # from here on, this code runs once per rank (under `fabriclite run`: a no-op)

print(
    f"rank {fabric.global_rank}: world_size={fabric.world_size} global_rank={fabric.global_rank} "
    f"local_rank={fabric.local_rank} node_rank={fabric.node_rank} device={fabric.device}",
    flush=True,
)
metrics = fabric.all_reduce({"loss": torch.tensor(1.0 + fabric.global_rank), "count": [fabric.global_rank, 1]},
                            reduce_op="sum")
fabric.print(f"all_reduce(sum) over {fabric.world_size} ranks: loss={metrics['loss'].item():g} "
             f"count={[c.item() for c in metrics['count']]}")
