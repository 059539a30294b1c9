"""The ranks' progress records as a node's supervisor reads them: one shared-memory record per rank and round
(supervision/rank/progress.py writes it inside the rank), created before the rank starts and read at most every
CHECK_EVERY_S, for the watchers (supervision/watch/watcher.py)."""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

from fabriclite.supervision.rank import progress as rank_progress
from fabriclite.supervision.watch.watcher import RoundView

#: how often the supervisor reads its ranks' records (seconds)
CHECK_EVERY_S = 0.5


class ProgressRecords:
    """This node's ranks' records: ``tmpdir`` (the supervisor's private folder), ``round`` (the round being played),
    ``last`` (global rank -> record as last read; empty at a round's start). ``global_rank``: local -> global."""

    def __init__(self, global_rank: Callable[[int], int]) -> None:
        self.global_rank = global_rank
        self.tmpdir = ""
        self.round = 0
        self.last: Dict[int, Optional[dict]] = {}
        self._next_read = 0.0

    def start_round(self, number: int) -> None:
        """Round ``number``'s records are new ones: the last round's are not its progress."""
        self.round, self.last = number, {}

    def progress_file(self, local_rank: int) -> str:
        return os.path.join(self.tmpdir, f"progress-{self.round}-{local_rank}")

    def rank_env(self, local_rank: int) -> Dict[str, str]:
        """A fresh record for the round's rank ``local_rank``, and the variable that names it to the rank."""
        path = self.progress_file(local_rank)
        rank_progress.create(path)
        return {rank_progress.PROGRESS_FILE_ENV: path}

    def read(self, local_ranks: Sequence[int]) -> Dict[int, Optional[dict]]:
        """Global rank -> its record now (None before it joined)."""
        return {self.global_rank(r): rank_progress.read(self.progress_file(r)) for r in local_ranks}

    def fewest_steps(self) -> Optional[int]:
        """The fewest optimizer steps a rank made in the round, as last read (None before every rank reported)."""
        if not self.last or any(r is None for r in self.last.values()):
            return None
        return min(int(r["steps"]) for r in self.last.values() if r is not None)

    def view(self, workers: Dict[int, Tuple[int, bool]]) -> Optional[RoundView]:
        """The records of ``workers`` (local rank -> (pid, running)) read now, or None when they were read less than
        CHECK_EVERY_S ago (or there are none)."""
        if not workers or time.monotonic() < self._next_read:
            return None
        self._next_read = time.monotonic() + CHECK_EVERY_S
        self.last = self.read(list(workers))
        return RoundView(self.last, workers)
