"""Node 0's supervisor hosts the job's store: it keeps it up until the other nodes have ended."""
from __future__ import annotations

import time
from typing import Any, Callable

from fabriclite.distributed import rendezvous

POLL_S = 0.05
#: how long node 0 keeps the store up after a failure, for the other nodes to read it
LINGER_S = 3.0
#: after a success, node 0 stops waiting for a node whose supervisor gave no sign of life for this long
HEARTBEAT_TIMEOUT_S = 30.0


def leave(store: Any, node_rank: int, num_nodes: int, failed: bool, signalled: Callable[[], bool]) -> None:
    """Across nodes, node 0 keeps the store (and so the failure record) up until every node has
    ended: after a success for as long as the other supervisors are alive (their heartbeat moves
    at least every HEARTBEAT_TIMEOUT_S), after a failure for at most LINGER_S."""
    try:
        store.set(f"ended/{node_rank}", "1")
        if node_rank != 0:
            return
        waiting = {n: (-1, time.monotonic()) for n in range(1, num_nodes)}  # beat, when it moved
        deadline = time.monotonic() + LINGER_S if failed else None
        while waiting:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            if deadline is None and (signalled() or store.check([rendezvous.FAILURE_KEY])):
                deadline = now + LINGER_S
            for n, (beat, moved) in list(waiting.items()):
                if store.check([f"ended/{n}"]):
                    del waiting[n]
                    continue
                current = store.add(f"beat/{n}", 0)
                if current != beat:
                    waiting[n] = (current, now)
                elif now - moved > HEARTBEAT_TIMEOUT_S:
                    del waiting[n]  # that supervisor is gone without a word: stop waiting for it
            time.sleep(POLL_S)
    except RuntimeError:
        pass
