"""ft_train.py's loop for replica groups of several ranks, written by hand on torch and torchft 0.2.0 only (no
fabriclite import): the reference the ft lane compares ``fabriclite run --fault-tolerant --devices 2`` against, bit
for bit (tests/integration/backends/lane_ft/test_lane_ft_groups.py).

One process per rank: ``python groups_by_hand.py OUT STEPS GROUP GROUP_RANK RANKS_PER_GROUP STORE_PORT LIGHTHOUSE``.
Group rank 0 hosts its group's TCPStore on ``127.0.0.1:STORE_PORT`` (0: a free port, written to
``OUT/store-<group>.port`` for the group's other ranks); the group's ranks meet on it in a gloo process
group (DDP inside the group), and each rank runs its own torchft Manager (rank = group rank, world size = the
group's, the group's store). Each DDP bucket is summed inside the group, then across the groups on the Manager's
process group, and divided by the number of ranks (a comm hook of this file). Every rank seeds 1234 (no init_sync:
every rank starts from the weights fabriclite gives every rank, group 0's rank 0's), and reads the data of its data
rank ``group * R + group rank``, as ft_train.py. At the end it writes ``OUT/final-<group>[.<rank>].pt``."""
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.distributed_c10d import AllreduceOptions
from torchft.checkpointing.pg_transport import PGTransport
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

out, steps, group, group_rank, ranks, store_port = sys.argv[1], *map(int, sys.argv[2:7])
lighthouse = sys.argv[7]
timeout = timedelta(seconds=60)
port_file = os.path.join(out, f"store-{group}.port")  # STORE_PORT 0: group rank 0's store takes a free port
if group_rank == 0:
    store = dist.TCPStore("127.0.0.1", store_port, ranks, is_master=True, timeout=timeout, wait_for_workers=False)
    with open(port_file + ".tmp", "w") as f:
        f.write(str(store.port))
    os.replace(port_file + ".tmp", port_file)
else:
    while not os.path.exists(port_file):
        time.sleep(0.05)
    store = dist.TCPStore("127.0.0.1", int(open(port_file).read()), ranks, is_master=False, timeout=timeout)
store_port = store.port
dist.init_process_group("gloo", store=dist.PrefixStore("by_hand", store), rank=group_rank, world_size=ranks)

torch.manual_seed(1234)
width, batch = int(os.environ.get("FT_WIDTH", "32")), int(os.environ.get("FT_BATCH", "32"))
model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
state = {"step": 0}

pg = ProcessGroupGloo(timeout=timeout)
manager = Manager(pg=pg, load_state_dict=lambda s: model.load_state_dict(s), state_dict=model.state_dict,
                  min_replica_size=2, use_async_quorum=True, timeout=timeout, quorum_timeout=timeout,
                  connect_timeout=timedelta(seconds=10), rank=group_rank, world_size=ranks,
                  store_addr="127.0.0.1", store_port=store_port, lighthouse_addr=f"http://{lighthouse}",
                  replica_id=f"by_hand_{group}", hostname="127.0.0.1",
                  checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")), init_sync=False)


def hook(manager: Manager, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sum the bucket inside the group, then across the groups; divide by every rank that contributed."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    manager.wait_quorum()
    options = AllreduceOptions()
    options.reduceOp = dist.ReduceOp.SUM
    manager._pg.allreduce([buffer], options).wait()
    buffer.div_(manager.num_participants() * ranks)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)  # one bucket: the MLP is small
ddp.register_comm_hook(manager, hook)
data_rank = group * ranks + group_rank
while state["step"] < steps:
    manager.start_quorum()
    optimizer.zero_grad()
    gen = torch.Generator().manual_seed(100_000 * data_rank + state["step"])
    x = torch.randn(batch, 16, generator=gen)
    loss = ((ddp(x) - x.sum(1, keepdim=True).tanh()) ** 2).mean()
    loss.backward()
    if manager.should_commit():
        optimizer.step()
        state["step"] += 1
name = str(group) if group_rank == 0 else f"{group}.{group_rank}"
torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, f"final-{name}.pt"))
manager.shutdown(wait=False)
dist.destroy_process_group()
