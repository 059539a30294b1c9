"""One rank of step_timing.py's training job (run under ``fabriclite run --num-nodes 2``): DDP on gloo, an MLP on
fixed synthetic batches, AdamW; each step timed (zero_grad, forward, backward, step) after $WARMUP steps, $STEPS
in all. Global rank 0 writes the step times (seconds) as JSON to $STEP_TIMES."""
import json
import os
import time

import torch
from torch import nn

from fabriclite import Fabric

STEPS, WARMUP = int(os.environ.get("STEPS", "1000")), int(os.environ.get("WARMUP", "100"))
WIDTH, BATCH = 128, 64

fabric = Fabric(accelerator="cpu")
fabric.launch()
fabric.seed_everything(5, verbose=False)
model = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.ReLU(), nn.Linear(4 * WIDTH, 4 * WIDTH), nn.ReLU(),
                      nn.Linear(4 * WIDTH, 8))
model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
generator = torch.Generator().manual_seed(fabric.global_rank)
batches = [(torch.randn(BATCH, WIDTH, generator=generator), torch.randint(0, 8, (BATCH,), generator=generator))
           for _ in range(16)]
times = []
fabric.barrier()
for step in range(WARMUP + STEPS):
    x, y = batches[step % len(batches)]
    start = time.perf_counter()
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    if step >= WARMUP:
        times.append(time.perf_counter() - start)
fabric.barrier()
if fabric.global_rank == 0:
    with open(os.environ["STEP_TIMES"], "w") as f:
        json.dump(times, f)
