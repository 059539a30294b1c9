"""One rank of a multi-node test job. It checks many things in one start (starting ranks is the slow part)
and prints one line ``RESULT {json}`` with what it saw; the test computes what is expected.

Environment: JOB_FABRIC_KWARGS (JSON keyword arguments of Fabric(), default {}), JOB_FAIL_RANK (that rank
raises after the first barrier while the others wait in a second one), JOB_EVENTS (a folder for the files through
which the ranks observe each other's progress).
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

# rank_zero_first(local=True): each node's local rank 0 runs the block first, every node at once. Observed through
# files in JOB_EVENTS (a folder every node sees), not clocks: each local rank 0 waits inside its block until every
# node's local rank 0 is inside its own (were the nodes taking turns, that would never happen), then marks its block
# done; the node's other ranks check, inside theirs, that the mark is there.
events, node, local = os.environ["JOB_EVENTS"], fabric.node_rank, fabric.local_rank


def mark(name: str) -> None:
    open(os.path.join(events, name), "w").close()


def seen(names, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while not all(os.path.exists(os.path.join(events, n)) for n in names):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


fabric.barrier()
with fabric.rank_zero_first(local=True):
    if local == 0:
        mark(f"zero-in-{node}")
        zero_first = {"all_nodes_in_at_once": seen([f"zero-in-{k}" for k in range(fabric.num_nodes)], 60)}
        mark(f"zero-done-{node}")
    else:
        zero_first = {"zero_done_seen": os.path.exists(os.path.join(events, f"zero-done-{node}"))}

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
    "zero_first": zero_first,
    "all_reduce": {"vec": reduced["vec"].tolist(), "int": reduced["nested"]["int"].item(),
                   "list": [t.item() for t in reduced["nested"]["list"]]},
    "all_gather": {"rank": gathered["rank"].tolist(), "pair": gathered["nested"]["pair"].tolist()},
}
sys.stdout.flush()
os.write(1, f"RESULT {json.dumps(result)}\n".encode())  # one write: the node's ranks share one pipe
fabric.barrier()
