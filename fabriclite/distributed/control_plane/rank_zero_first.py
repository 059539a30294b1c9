"""``rank_zero_first`` through the job's store: the first rank runs the block and says how it went; the others wait
for that word without a deadline (rank 0 may download for an hour), but not past a failure a supervisor
published. Takes the job's store seen under ``keys.PREFIX``."""
from __future__ import annotations

import time
from typing import Any

from fabriclite.distributed.control_plane import failure_flag

_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.1


def announce(store: Any, key: str, outcome: str) -> None:
    """The first rank's ``outcome`` of the block under ``key`` (``keys.rank_zero_first``)."""
    store.set(key, outcome)


def wait(store: Any, key: str) -> str:
    """Poll ``key`` until it exists, without a deadline; the first rank's outcome. JobFailedElsewhere when a
    supervisor publishes a failure meanwhile."""
    delay = _POLL_FIRST_S
    while not store.check([key]):
        time.sleep(delay)
        delay = min(delay * 1.5, _POLL_MAX_S)
        if delay == _POLL_MAX_S:  # a failure elsewhere in the job ends the wait (JobFailedElsewhere)
            failure_flag.raise_if_failed(store, "waiting for rank 0 in rank_zero_first")
    raw = store.get(key)
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
