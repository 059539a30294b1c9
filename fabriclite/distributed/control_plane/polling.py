"""How the control plane waits: a poller makes O(1) store requests per ``poll()`` and says, with ``delay()``, when
to poll next (a backoff that starts short and grows to a ceiling that grows with the number of waiters, so that
the store's load stays bounded however many wait). A real supervisor or rank turns a poller with
:func:`wait_until` (``time.sleep`` between polls); a simulation turns the same poller from its event loop."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional, TypeVar

T = TypeVar("T")

#: the store requests per second that a crowd of waiters may send in all, at their ceiling (see ceiling)
CROWD_REQUESTS_S = 20000.0


def ceiling(waiters: int, floor_s: float) -> float:
    """The longest delay between two polls of one of ``waiters`` waiters: ``floor_s``, or longer where that many
    waiters polling every ``floor_s`` would send more than CROWD_REQUESTS_S requests per second in all."""
    return max(floor_s, waiters / CROWD_REQUESTS_S)


class Backoff:
    """Delays that start at ``first_s`` and grow by ``factor`` up to ``most_s``."""

    def __init__(self, first_s: float, most_s: float, factor: float = 2.0) -> None:
        self.current, self.most_s, self.factor = first_s, most_s, factor

    def next(self) -> float:
        delay = self.current
        self.current = min(self.current * self.factor, self.most_s)
        return delay


def wait_until(poll: Callable[[], Optional[T]], delay: Callable[[], float],
               sleep: Callable[[float], Any] = time.sleep) -> T:
    """Call ``poll`` until it returns something other than None (or False); sleep ``delay()`` between calls."""
    while True:
        result = poll()
        if result is not None and result is not False:
            return result
        sleep(delay())
