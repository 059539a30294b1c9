"""A 2,000-step job for the store's key count (run it under `fabriclite run` on every node): optimizer steps (what
the supervisors count into straggler windows) without a backward, so that the steps are quick on a loaded
machine; a ``rank_zero_first`` block every 100 steps; at steps 200 and STEPS every rank waits a moment (the supervisors
catch up on the straggler windows the steps completed) and rank 0 prints ``KEYS step=<s> n=<num_keys>``."""
import os
import time

import torch
from torch import nn

from fabriclite import Fabric

STEPS = int(os.environ.get("STEPS", "2000"))

fabric = Fabric(accelerator="cpu")
fabric.launch()
model = nn.Linear(4, 1)
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
for step in range(1, STEPS + 1):
    optimizer.step()
    time.sleep(0.001)
    if step % 100 == 0:
        with fabric.rank_zero_first():
            pass
    if step in (200, STEPS):
        time.sleep(1.5)  # the supervisors read their ranks' progress every 0.5 s: every window of these steps is in
        fabric.barrier()
        if fabric.global_rank == 0:
            print(f"KEYS step={step} n={fabric.strategy.store.num_keys()}", flush=True)
        fabric.barrier()
