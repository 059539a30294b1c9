"""Liveness across nodes: each supervisor's heartbeat, and node 0 keeping the store up until the other nodes have
ended. Every function takes the job's store seen under ``keys.PREFIX`` (round 0's part: ``meeting.job_view``)."""
from __future__ import annotations

import time
from typing import Any, Callable

from fabriclite.distributed.control_plane import failure_flag, keys

POLL_S = 0.05
#: how long node 0 keeps the store up after a failure, for the other nodes to read it
LINGER_S = 3.0
#: after a success, node 0 stops waiting for a node whose supervisor gave no sign of life for this long
HEARTBEAT_TIMEOUT_S = 30.0


def beat(store: Any, node_rank: int) -> None:
    """Tell node 0's supervisor that node ``node_rank``'s is alive (it waits for live nodes before it leaves).
    Never raises: the next read of the failure flag reports a lost store."""
    try:
        store.add(keys.beat(node_rank), 1)
    except RuntimeError:
        pass


def leave(store: Any, node_rank: int, num_nodes: int, failed: bool, signalled: Callable[[], bool]) -> None:
    """Across nodes, node 0 keeps the store (and so the failure record) up until every node has
    ended: after a success for as long as the other supervisors are alive (their heartbeat moves
    at least every HEARTBEAT_TIMEOUT_S), after a failure for at most LINGER_S."""
    try:
        store.set(keys.ended(node_rank), "1")
        if node_rank != 0:
            return
        waiting = {n: (-1, time.monotonic()) for n in range(1, num_nodes)}  # beat, when it moved
        deadline = time.monotonic() + LINGER_S if failed else None
        while waiting:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            if deadline is None and (signalled() or failure_flag.failed(store)):
                deadline = now + LINGER_S
            for n, (beat_count, moved) in list(waiting.items()):
                if store.check([keys.ended(n)]):
                    del waiting[n]
                    continue
                current = store.add(keys.beat(n), 0)
                if current != beat_count:
                    waiting[n] = (current, now)
                elif now - moved > HEARTBEAT_TIMEOUT_S:
                    del waiting[n]  # that supervisor is gone without a word: stop waiting for it
            time.sleep(POLL_S)
    except RuntimeError:
        pass
