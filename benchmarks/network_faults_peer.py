"""The peers' side of benchmarks/network_faults.py: the same DDP loop as tests/integration/netns/network_faults_job.py,
one process per host, started by hand as a user of each would (no supervisor): ``torch`` (raw
``init_process_group("gloo", init_method="tcp://...", timeout=30 s)`` and DDP) or ``lightning`` (Lightning Fabric,
``num_nodes=3``, its environment variables, its default timeout). Rank 0 prints ``AT <step>`` at FAULT_AT."""
import os
import sys
import time
from datetime import timedelta

import torch
from torch import nn

kind = sys.argv[1]
STEPS, FAULT_AT = int(os.environ.get("STEPS", "100000")), int(os.environ.get("FAULT_AT", "200"))
torch.manual_seed(7)
model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
if kind == "torch":
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=30))
    model = nn.parallel.DistributedDataParallel(model)

    def backward(loss):
        loss.backward()
else:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, num_nodes=int(os.environ["WORLD_SIZE"]))
    fabric.launch()
    rank = fabric.global_rank
    model, optimizer = fabric.setup(model, optimizer)
    backward = fabric.backward
generator = torch.Generator().manual_seed(100 + rank)
for step in range(1, STEPS + 1):
    loss = model(torch.randn(16, 32, generator=generator)).pow(2).mean()
    optimizer.zero_grad()
    backward(loss)
    optimizer.step()
    time.sleep(0.01)
    if rank == 0 and step == FAULT_AT:
        print(f"AT {step}", flush=True)
