"""A watcher (supervision/watch/watcher.py): each rank's optimizer steps per second, as a ``steps`` event every
``$FABRICLITE_STEPS_EVERY`` seconds (default :data:`DEFAULT_EVERY_S`; 0 turns them off) while the round's ranks
step: ``round``, ``seconds`` (the interval), ``steps`` (global rank -> steps made in the round so far) and
``per_second`` (global rank -> steps per second over the interval). It reads the progress records the supervisor
reads anyway: no cost in the ranks, one short line in the record per interval."""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

from fabriclite.supervision.watch.watcher import Event, RoundView

STEPS_EVERY_ENV = "FABRICLITE_STEPS_EVERY"
DEFAULT_EVERY_S = 10.0


def steps_every() -> float:
    """``$FABRICLITE_STEPS_EVERY`` in seconds (0: off); ValueError naming a value that is not a number >= 0."""
    raw = os.environ.get(STEPS_EVERY_ENV, "").strip()
    if not raw:
        return DEFAULT_EVERY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"${STEPS_EVERY_ENV}={raw!r} is not valid: expected seconds between steps events, a "
                         "number >= 0 (0: off).")
    return value


class StepRates:
    """See the module docstring."""

    def __init__(self, every_s: Optional[float] = None) -> None:
        self.every_s = steps_every() if every_s is None else every_s
        self.round = 0
        self._since = 0.0
        self._seen: Dict[int, int] = {}

    def start_round(self, number: int) -> None:
        self.round, self._since, self._seen = number, time.time(), {}

    def observe(self, view: RoundView) -> List[Event]:
        now = time.time()
        if not self.every_s or now - self._since < self.every_s:
            return []
        counts = {rank: int(record["steps"]) for rank, record in view.records.items() if record}
        since, seen = self._since, self._seen
        if not seen:  # the round's first interval starts at its first step, not at its start-up
            firsts = [r["first_step_time"] for r in view.records.values() if r and r.get("first_step_time")]
            since = max(since, min(firsts)) if firsts else since
        self._since, self._seen = now, counts
        seconds = now - since
        if seconds <= 0 or not any(counts[r] - seen.get(r, 0) for r in counts):
            return []  # no rank stepped in the interval (start-up, evaluation, a hang): nothing to draw
        return [Event("steps", {"round": self.round, "seconds": round(seconds, 3),
                                "steps": {str(r): n for r, n in sorted(counts.items())},
                                "per_second": {str(r): round((n - seen.get(r, 0)) / seconds, 3)
                                               for r, n in sorted(counts.items())}})]
