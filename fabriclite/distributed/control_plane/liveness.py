"""Liveness across nodes: each supervisor's pulse, and node 0 keeping the store up until the other nodes have
ended. Every function takes the job's store seen under ``keys.PREFIX`` (the round's part: ``meeting.job_view``).

One counter, ``pulse``, for every supervisor: each adds 1 every PULSE_S, and the answer says whether the failure
flag is up (``failure_flag.publish_failure`` adds ``keys.FAILED`` to it). So a supervisor's steady-state traffic is
one request per PULSE_S, the failure is seen within PULSE_S everywhere, and node 0 leaving knows that someone is
still alive while the count moves.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

from fabriclite.distributed.control_plane import failure_flag, keys, polling

#: how often each supervisor pulses (and so reads the failure flag): a failure is seen everywhere within it, and
#: with the ranks' progress records and the straggler reports a node sends at most ~1 request per second
PULSE_S = 1.5
POLL_S = 0.05
#: how long node 0 keeps the store up after a failure, for the other nodes to read it
LINGER_S = 3.0
#: after a success, node 0 stops waiting for the nodes that have not ended once no supervisor pulsed for this long
HEARTBEAT_TIMEOUT_S = 30.0


def pulse(store: Any) -> Optional[Dict[str, Any]]:
    """One pulse of this node's supervisor: None, or the job's failure once it is published (a store that cannot be
    reached counts as one: its host, node 0's supervisor, is gone). One request; two once the flag is up."""
    try:
        count = store.add(keys.PULSE, 1)
    except RuntimeError:
        return failure_flag.read_failure(store)  # says the store is gone
    return failure_flag.flagged_failure(store) if failure_flag.flagged(count) else None


def leave(store: Any, node_rank: int, num_nodes: int, failed: bool, signalled: Callable[[], bool]) -> None:
    """Across nodes, node 0 keeps the store (and so the failure record) up until every node has
    ended: after a success for as long as a supervisor that has not ended is alive (the pulse moves
    at least every HEARTBEAT_TIMEOUT_S), after a failure for at most LINGER_S. Two requests per poll."""
    try:
        ended = store.add(keys.ENDED, 1)
        if node_rank != 0:
            return
        deadline = time.monotonic() + LINGER_S if failed else None
        last, moved = store.add(keys.PULSE, 0), time.monotonic()
        backoff = polling.Backoff(POLL_S, 0.5)
        while ended < num_nodes:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            count = store.add(keys.PULSE, 0)
            if deadline is None and (signalled() or failure_flag.flagged(count)):
                deadline = now + LINGER_S
            if count != last:
                last, moved = count, now
            elif now - moved > HEARTBEAT_TIMEOUT_S:
                return  # the supervisors left are gone without a word: stop waiting for them
            time.sleep(backoff.next())
            ended = store.add(keys.ENDED, 0)
    except RuntimeError:
        pass
