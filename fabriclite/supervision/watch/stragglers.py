"""Stragglers named: the rank that holds the others back, seen by the supervisors without touching what DDP computes.

In synchronous training every rank's wall-clock step is the same (the slow rank holds the others in the gradient
all-reduce), so what is compared is each rank's **busy time**: its time outside waits on the others. Each rank
measures, per step (one call of ``FabricOptimizer.step``), the time since its previous step less the time spent in
``fabric.backward`` (which holds the wait for the gradient all-reduce) and in fabriclite's collectives; the
straggler waits least, so it is the busiest. No comm hook, nothing added to a gradient bucket: the numbers go from
the rank to its supervisor through the rank's shared-memory record (supervision/rank/progress.py), and from the
supervisors of the other nodes to node 0's through the job's store (control_plane/straggler_reports.py), once per
window. Limit: a rank slow *inside* backward's own compute
is not told apart (its compute and the others' wait are both in backward).

- A **window** is ``$FABRICLITE_STRAGGLER_WINDOW`` steps (default 50). Once every rank has passed a window's end,
  each rank's busy time per step over the window is compared with the median of all ranks.
- A rank busier than the median by more than ``$FABRICLITE_STRAGGLER_THRESHOLD`` (a fraction, default 0.25: 25%)
  for ``$FABRICLITE_STRAGGLER_WINDOWS`` windows in a row (default 3) is named once, in one line on node 0's stderr
  and a ``straggler`` event; it is named again only after it has caught up. The progress bar (rank 0) shows the
  slowest rank while one is named. ``FABRICLITE_STRAGGLER_WINDOW=0`` turns the check off.
"""
from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from fabriclite.distributed.control_plane import straggler_reports
from fabriclite.supervision.rank.progress import write_slowest
from fabriclite.supervision.watch.progress_records import ProgressRecords
from fabriclite.supervision.watch.watcher import Event, RoundView

WINDOW_ENV, THRESHOLD_ENV, WINDOWS_ENV = ("FABRICLITE_STRAGGLER_WINDOW", "FABRICLITE_STRAGGLER_THRESHOLD",
                                          "FABRICLITE_STRAGGLER_WINDOWS")
DEFAULT_WINDOW, DEFAULT_THRESHOLD, DEFAULT_WINDOWS = 50, 0.25, 3


def _setting(name: str, default: float, kind: Callable[[str], Any], minimum: float, what: str) -> Any:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(f"${name}={raw!r} is not valid: expected {what}.")
    return value


class StragglerWatch:
    """One supervisor's side, a watcher (supervision/watch/watcher.py): ``observe`` with its ranks' progress records
    as it reads them; on node 0, returns a ``straggler`` event (with its line) per new straggler, and shows the
    slowest rank to the progress bar through the ranks' records (``progress``; None: not shown). ``store``: the
    job's store across nodes (None on one node); ``node_of``: global rank -> node."""

    def __init__(self, node_rank: int, num_nodes: int, node_of: Callable[[int], int],
                 progress: Optional[ProgressRecords] = None) -> None:
        self.window = _setting(WINDOW_ENV, DEFAULT_WINDOW, int, 0, "a whole number of steps >= 0 (0: off)")
        self.threshold = _setting(THRESHOLD_ENV, DEFAULT_THRESHOLD, float, 0.0,
                                  "a fraction >= 0 (0.25: 25% slower than the median)")
        self.windows = _setting(WINDOWS_ENV, DEFAULT_WINDOWS, int, 1, "a whole number of windows >= 1")
        self.node_rank, self.num_nodes, self.node_of = node_rank, num_nodes, node_of
        self.progress = progress
        self.store: Any = None
        self.reset()

    def start_round(self, number: int) -> None:
        self.reset()

    def reset(self) -> None:
        """A new round: the ranks' counts start again."""
        self._next = 1  # the window being waited for
        self._reports = straggler_reports.Collector(self.num_nodes)
        self._at: Dict[int, Tuple[int, int]] = {}  # rank -> (steps, busy ns) at the last window end
        self._streak: Dict[int, int] = {}
        self._named: Dict[int, float] = {}
        self.slowest: Optional[Tuple[int, float]] = None
        self._shown: Optional[Tuple[int, float]] = None

    # ------------------------------------------------------------------ per node
    def observe(self, view: RoundView) -> List[Event]:
        """A ``straggler`` event per rank newly found too slow (node 0), and the slowest shown to the progress bar."""
        found = [Event("straggler", {"rank": s.rank, "node": s.node, "slower": round(s.slower, 4),
                                     "windows": s.windows}, s.line) for s in self.stragglers(view.records)]
        if self.slowest != self._shown and self.progress is not None:
            self._shown = self.slowest
            rank, slower = self.slowest or (-1, 0.0)
            for local_rank in view.workers:
                write_slowest(self.progress.progress_file(local_rank), rank, slower)
        return found

    def stragglers(self, records: Dict[int, Optional[dict]]) -> List["Straggler"]:
        """The ranks newly found too slow in the windows ``records`` (global rank -> record) completed (node 0)."""
        if not self.window or not records or any(r is None for r in records.values()):
            return []
        last = min(r["steps"] for r in records.values()) // self.window  # type: ignore[index]
        if last < self._next:
            return []
        mine = {}  # busy seconds per step since the previous window's end (several windows if read late)
        for rank, r in records.items():
            steps, busy = r["steps"], r["busy_ns"]  # type: ignore[index]
            before = self._at.get(rank, (0, 0))
            if steps > before[0]:
                mine[rank] = (busy - before[1]) / (steps - before[0]) / 1e9
            self._at[rank] = (steps, busy)
        found: List[Straggler] = []
        for number in range(self._next, last + 1):
            found += self._window(number, mine)
        self._next = last + 1
        return found

    def _window(self, number: int, mine: Dict[int, float]) -> List["Straggler"]:
        if self.num_nodes > 1 and self.store is not None:
            if not straggler_reports.publish(self.store, number, self.node_rank, mine) or self.node_rank != 0:
                return []
            # node 0 judges each window once every node has reported it (straggler_reports.Collector)
            found: List[Straggler] = []
            for everyone in self._reports.collect(self.store, number):
                found += self.judge(everyone)
            return found
        return self.judge(mine)

    # ------------------------------------------------------------------ the decision
    def judge(self, busy: Dict[int, float]) -> List["Straggler"]:
        """One window's busy seconds per step per rank: the lines naming ranks that were too slow for long enough."""
        if len(busy) < 2:
            return []
        median = statistics.median(busy.values())
        if median <= 0:
            return []
        lines = []
        worst = max(busy, key=lambda r: busy[r])
        for rank, value in busy.items():
            slower = value / median - 1.0
            if slower > self.threshold:
                self._streak[rank] = self._streak.get(rank, 0) + 1
            else:
                self._streak[rank] = 0
                self._named.pop(rank, None)
            if self._streak[rank] >= self.windows and rank not in self._named:
                self._named[rank] = slower
                lines.append(Straggler(rank, self.node_of(rank), slower, self._streak[rank], f"fabriclite: straggler: rank {rank} (node {self.node_of(rank)}) is {100 * slower:.0f}% "
                             f"slower than the median rank (time outside waits on the others: {value * 1e3:.1f} ms per "
                             f"step against {median * 1e3:.1f} ms) for {self._streak[rank]} windows of {self.window} "
                             f"steps in a row (threshold {100 * self.threshold:.0f}%, ${THRESHOLD_ENV})."))
        slower = busy[worst] / median - 1.0
        self.slowest = (worst, slower) if worst in self._named else None
        return lines


@dataclass
class Straggler:
    rank: int
    node: int
    #: fraction slower than the median (0.5: 50%)
    slower: float
    windows: int
    line: str
