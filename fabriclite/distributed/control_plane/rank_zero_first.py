"""``rank_zero_first`` through the job's store: the first rank runs the block and says how it went; the others wait
for that word without a deadline (rank 0 may download for an hour), but not past a failure a supervisor
published. The last waiting rank to read the word deletes it, so no key is left per call. Takes the job's store
seen under ``keys.PREFIX``."""
from __future__ import annotations

import time
from typing import Any, Optional

from fabriclite.distributed.control_plane import failure_flag, keys, polling

_POLL_FIRST_S, _POLL_MOST_S = 0.001, 0.1


def announce(store: Any, key: str, outcome: str, readers: Optional[int]) -> None:
    """The first rank's ``outcome`` of the block under ``key`` (``keys.rank_zero_first``), for ``readers`` waiting
    ranks (0: nothing to say; None: not known, the word is kept)."""
    if readers != 0:
        store.set(key, outcome)


class Waiter:
    """One waiting rank: :meth:`poll` until it returns the outcome (``delay()`` seconds apart). One request per poll
    (a check), and, once its backoff is at the ceiling, a read of the failure record at most every
    ``failure_flag.FAILURE_CHECK_S``."""

    def __init__(self, store: Any, key: str, readers: Optional[int]) -> None:
        self.store, self.key, self.readers = store, key, readers
        self._backoff = polling.Backoff(_POLL_FIRST_S, polling.ceiling(readers or 1, _POLL_MOST_S), 1.5)
        self._checked: Optional[float] = None

    def poll(self) -> Optional[str]:
        """The outcome, or None while rank 0 is in the block; JobFailedElsewhere when a supervisor published a
        failure meanwhile."""
        if not self.store.check([self.key]):
            self._checked = failure_flag.check_now(self.store, "waiting for rank 0 in rank_zero_first", self._checked,
                                                   self._backoff.current >= self._backoff.most_s)
            return None
        raw = self.store.get(self.key)
        # the last reader deletes the word: nobody needs it any more
        if self.readers is not None and self.store.add(keys.readers(self.key), 1) >= self.readers:
            self.store.delete_key(self.key)
            self.store.delete_key(keys.readers(self.key))
        return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)

    def delay(self) -> float:
        return self._backoff.next()


def wait(store: Any, key: str, readers: Optional[int]) -> str:
    """Wait for the first rank's outcome under ``key`` without a deadline (one of ``readers`` waiting ranks);
    JobFailedElsewhere when a supervisor publishes a failure meanwhile."""
    waiter = Waiter(store, key, readers)
    return polling.wait_until(waiter.poll, waiter.delay)
