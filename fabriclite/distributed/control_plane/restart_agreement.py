"""The restart agreement: after a failed round every node's supervisor reports whether it can go on; node 0's
decides for the job and publishes the delay before the next round (or None: stop). Takes the job's store itself
(the keys ``restarts/<round>/...`` are outside ``keys.PREFIX`` and outside any round's part)."""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional

from fabriclite.distributed.control_plane import keys

#: how long node 0 waits for every node's report after a failed round, and the others for its decision
AGREE_S = 60.0
_POLL_S = 0.05


def agree(store: Any, round_number: int, node_rank: int, num_nodes: int, able: bool,
          allowed: Callable[[], Optional[float]]) -> Optional[float]:
    """The delay before the round after ``round_number``, the same on every node, or None to stop. ``able``: whether
    this node can go on; ``allowed()`` (node 0 only): the delay the restart policy allows, or None. A node that
    does not report within AGREE_S ends the job; a store that is gone (RuntimeError) means no restart."""
    try:
        store.set(keys.restart_report(round_number, node_rank), "1" if able else "0")
        if node_rank != 0:
            return _wait_decision(store, round_number)
        reports = [keys.restart_report(round_number, n) for n in range(num_nodes)]
        deadline = time.monotonic() + AGREE_S
        while not all(store.check([key]) for key in reports):
            if time.monotonic() > deadline:
                able = False
                break
            time.sleep(_POLL_S)
        else:
            able = able and all(store.get(key) == b"1" for key in reports)
        delay = allowed() if able else None
        store.set(keys.restart_decision(round_number), json.dumps({"delay": delay}))
        return delay
    except RuntimeError:  # node 0's store is gone: the job cannot restart
        return None


def _wait_decision(store: Any, round_number: int) -> Optional[float]:
    key = keys.restart_decision(round_number)
    deadline = time.monotonic() + AGREE_S + 5
    while not store.check([key]):
        if time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)
    return json.loads(store.get(key))["delay"]
