"""Collective progress in the job's store: each rank's collective-watch thread publishes how many collectives it
entered per group, and a rank whose collective failed reads the others' to name who did not arrive. Takes the
job's store seen under ``keys.PREFIX`` (the round's part)."""
from __future__ import annotations

import json
from typing import Any, Dict, Optional

from fabriclite.distributed.control_plane import keys


#: the longest and shortest time between two of a rank's records (seconds)
MOST_INTERVAL_S, LEAST_INTERVAL_S = 120.0, 1.0


def publish_interval(timeout_s: float) -> float:
    """How often a rank publishes its counts under collective timeout ``timeout_s``: a fifteenth of it, between 1 s
    and 120 s. The records are read only after a collective failed, which takes the timeout; a stuck rank's counts
    do not move, so a record that old is still its last word, and a job at the default 30-minute timeout sends one
    record per rank every 2 minutes instead of one per second."""
    return min(MOST_INTERVAL_S, max(LEAST_INTERVAL_S, timeout_s / 15.0))


def publish(store: Any, rank: int, record: Dict[str, Any]) -> None:
    """Publish rank ``rank``'s ``record`` (``counts``: group label -> [count, last collective's name], ``time``,
    ``left``). Raises RuntimeError when the store is gone."""
    store.set(keys.collective_progress(rank), json.dumps(record))


def read(store: Any, rank: int) -> Optional[Dict[str, Any]]:
    """Rank ``rank``'s last published record, or None before its first. Raises RuntimeError when the store is gone,
    ValueError when the record is not JSON."""
    key = keys.collective_progress(rank)
    return json.loads(store.get(key)) if store.check([key]) else None
