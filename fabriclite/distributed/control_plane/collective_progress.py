"""Collective progress in the job's store: each rank's collective-watch thread publishes how many collectives it
entered per group, and a rank whose collective failed reads the others' to name who did not arrive. Takes the
job's store seen under ``keys.PREFIX`` (the round's part)."""
from __future__ import annotations

import json
from typing import Any, Dict, Optional

from fabriclite.distributed.control_plane import keys


def publish(store: Any, rank: int, record: Dict[str, Any]) -> None:
    """Publish rank ``rank``'s ``record`` (``counts``: group label -> [count, last collective's name], ``time``,
    ``left``). Raises RuntimeError when the store is gone."""
    store.set(keys.collective_progress(rank), json.dumps(record))


def read(store: Any, rank: int) -> Optional[Dict[str, Any]]:
    """Rank ``rank``'s last published record, or None before its first. Raises RuntimeError when the store is gone,
    ValueError when the record is not JSON."""
    key = keys.collective_progress(rank)
    return json.loads(store.get(key)) if store.check([key]) else None
