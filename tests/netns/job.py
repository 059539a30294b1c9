"""One rank of a multi-node test job. It checks many things in one start (starting ranks is the slow part)
and prints one line ``RESULT {json}`` with what it saw; the test computes what is expected.

Environment: JOB_FABRIC_KWARGS (JSON keyword arguments of Fabric(), default {}), JOB_FAIL_RANK (that rank
raises after the first barrier while the others wait in a second one).
"""
import json
import os
import socket
import sys
import time

import torch

from fabriclite import Fabric

fabric = Fabric(accelerator="cpu", **json.loads(os.environ.get("JOB_FABRIC_KWARGS", "{}")))
fabric.launch()
rank = fabric.global_rank
fabric.barrier()

if int(os.environ.get("JOB_FAIL_RANK", -1)) >= 0:
    if rank == int(os.environ["JOB_FAIL_RANK"]):
        os.write(1, f"RAISING {json.dumps({'rank': rank, 'time': time.time()})}\n".encode())
        raise RuntimeError(f"injected failure on rank {rank}")
    fabric.barrier()  # never completes: the failed rank does not arrive
    time.sleep(600)

# rank_zero_first(local=True): each node's local rank 0 runs the block first, every node at once
fabric.barrier()
with fabric.rank_zero_first(local=True):
    entered = time.time()
    if fabric.local_rank == 0:
        time.sleep(0.5)
    left = time.time()

fabric.print(f"PRINTED node={fabric.node_rank} rank={rank}", flush=True)

mine = {"vec": torch.tensor([rank, 2.0 * rank]),
        "nested": {"int": torch.tensor(rank), "list": [torch.tensor(1.0 + rank)]}}
reduced = fabric.all_reduce(mine, reduce_op="sum")
gathered = fabric.all_gather({"rank": torch.tensor(rank), "nested": {"pair": torch.tensor([rank, -rank])}})

result = {
    "global_rank": rank,
    "local_rank": fabric.local_rank,
    "node_rank": fabric.node_rank,
    "world_size": fabric.world_size,
    "num_nodes": fabric.num_nodes,
    "hostname": socket.gethostname(),
    "environment": type(fabric.strategy.cluster_environment).__name__,
    "zero_first": {"entered": entered, "left": left},
    "all_reduce": {"vec": reduced["vec"].tolist(), "int": reduced["nested"]["int"].item(),
                   "list": [t.item() for t in reduced["nested"]["list"]]},
    "all_gather": {"rank": gathered["rank"].tolist(), "pair": gathered["nested"]["pair"].tolist()},
}
sys.stdout.flush()
os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: the node's ranks share one pipe
fabric.barrier()
