"""One rank of the network-fault tests' job: DDP on a small model, STEPS steps, a short sleep in each (so the job
runs long enough to be faulted); global rank 0 prints ``AT <step>`` at FAULT_AT (the test faults the network then),
``STEP <n> <seconds>`` every 10 steps, and saves the final weights to OUT."""
import os
import time

import torch
from torch import nn

from fabriclite import Fabric

STEPS, FAULT_AT = int(os.environ.get("STEPS", "400")), int(os.environ.get("FAULT_AT", "200"))

fabric = Fabric(accelerator="cpu")
fabric.launch()
fabric.seed_everything(7, verbose=False)
model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = fabric.setup(model, optimizer)
generator = torch.Generator().manual_seed(100 + fabric.global_rank)
start = time.monotonic()
for step in range(1, STEPS + 1):
    x = torch.randn(16, 32, generator=generator)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()
    time.sleep(0.01)
    if fabric.global_rank == 0 and (step == FAULT_AT or step % 10 == 0):
        print(f"AT {step}" if step == FAULT_AT else f"STEP {step} {time.monotonic() - start:.2f}", flush=True)
if fabric.global_rank == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.environ["OUT"])
print(f"DONE rank {fabric.global_rank}", flush=True)
