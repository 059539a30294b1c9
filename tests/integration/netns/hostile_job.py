"""One rank of the hostile-network test's job: DDP on a small model, STEPS steps; a `rank_zero_first` block at the
start; at step ATTACK_AT global rank 0 prints ``AT`` and waits until the file $ATTACKS_DONE exists (the test attacks
the job meanwhile; the others wait in the next all-reduce). At the end rank 0 saves the weights to $OUT and writes
$KEYS: every key in the job's store (read on node 0's loopback, where the store is) and whether any value holds the
job secret."""
import json
import os
import time
from datetime import timedelta

import torch
from torch import nn
from torch.distributed import TCPStore

from fabriclite import Fabric

STEPS, ATTACK_AT = int(os.environ.get("STEPS", "60")), int(os.environ.get("ATTACK_AT", "20"))

fabric = Fabric(accelerator="cpu")
fabric.launch()
fabric.seed_everything(11, verbose=False)
with fabric.rank_zero_first():
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = fabric.setup(model, optimizer)
generator = torch.Generator().manual_seed(200 + fabric.global_rank)
for step in range(1, STEPS + 1):
    x = torch.randn(8, 16, generator=generator)
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()
    if step == ATTACK_AT and fabric.global_rank == 0:
        print("AT", flush=True)
        while not os.path.exists(os.environ["ATTACKS_DONE"]):
            time.sleep(0.05)
fabric.barrier()
if fabric.global_rank == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.environ["OUT"])
    store = TCPStore(os.environ["FABRICLITE_STORE_ADDR"], int(os.environ["FABRICLITE_STORE_PORT"]), None, False,
                     timedelta(seconds=10))
    keys = store.list_keys()
    secret = open(os.environ["FABRICLITE_JOB_SECRET_FILE"], "rb").read().strip()
    values = store.multi_get(keys) if keys else []
    with open(os.environ["KEYS"], "w") as f:
        json.dump({"keys": sorted(keys), "secret_in_a_value": any(secret in v for v in values),
                   "attacker_in_a_value": any(b"attacker" in v or b"forged" in v for v in values)}, f)
fabric.barrier()
print(f"DONE rank {fabric.global_rank}", flush=True)
