"""DiLoCo written by hand on torchft 0.2.0, the reference the ft lane compares fabriclite's ``--strategy diloco``
with: diloco_train.py's model, seeds, data and inner optimizer (no BatchNorm, one fragment, no fault), torchft's
own Manager (synchronous quorum), ProcessGroupGloo and DiLoCo with the paper's outer SGD, started as fabriclite
starts (one quorum and one commit before the first step: every group takes group 0's initial state; torchft's
DiLoCo regression test commits twice there, so its loop starts at step 2). The process-group checkpoint transport, as fabriclite's: torchft's HTTP transport
advertises ``gethostname()``. Run one process per group:

    python diloco_by_hand.py OUT STEPS GROUP LIGHTHOUSE_HOST:PORT SYNC_EVERY MIN_REPLICAS

and it writes ``OUT/final-<group>.pt`` (the model's state_dict after STEPS inner steps).
"""
import os
import sys
from datetime import timedelta

import torch
from torch import nn
from torch.distributed import TCPStore
from torchft.checkpointing.pg_transport import PGTransport
from torchft.local_sgd import DiLoCo
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

out, steps, group, lighthouse = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sync_every, min_replicas = int(sys.argv[5]), int(sys.argv[6])

torch.manual_seed(1234 + group)
model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
inner = torch.optim.AdamW(model.parameters(), lr=0.01)
outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
manager = Manager(pg=pg, load_state_dict=None, state_dict=None, min_replica_size=min_replicas,
                  use_async_quorum=False, rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                  lighthouse_addr=f"http://{lighthouse}", replica_id=f"group_{group}", hostname="127.0.0.1",
                  checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=60), device=torch.device("cpu")),
                  timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=600),
                  connect_timeout=timedelta(seconds=10))


def load(state: dict) -> None:
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["inner"])


manager.register_state_dict_fn("train", load, lambda: {"model": model.state_dict(), "inner": inner.state_dict()})
with DiLoCo(manager, [model], inner, outer, sync_every=sync_every):
    manager.start_quorum()
    manager.should_commit()
    for step in range(steps):
        inner.zero_grad()
        gen = torch.Generator().manual_seed(100_000 * group + step)
        x = torch.randn(32, 16, generator=gen)
        loss = ((model(x) - x.sum(1, keepdim=True).tanh()) ** 2).mean()
        loss.backward()
        inner.step()

torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, f"final-{group}.pt"))
manager.shutdown(wait=False)
