"""Hangs, seen by a node's supervisor, explained with live stacks (supervision/watch/stacks.py).

A hang is:

- a rank reporting a collective timeout: fabriclite's ``CollectiveTimeout``, or the backend's own timeout (gloo's
  "Timed out waiting ... for recv", NCCL's watchdog) raised inside ``backward`` by DDP's gradient all-reduce;
- or no rank of the node completing an optimizer step (a call of ``FabricOptimizer.step``) for longer than the
  hang timeout, once the job has done its first step: that catches ranks stuck with nobody waiting on them.
  ``$FABRICLITE_HANG_TIMEOUT`` seconds (0: off), default twice the job's collective timeout
  (``fabriclite run --timeout``, ``$FABRICLITE_TIMEOUT``, 30 minutes), so that a collective timeout, which names
  the collective and the ranks that did not arrive, is reported first where there is one. Under
  ``--fault-tolerant`` (each node a replica group with its own supervisor) a group is hung when it commits no step
  for that long while its rank is not waiting on the other groups (in ``backward`` or a collective): a group whose
  rank waits is held up by another, which its own supervisor finds hung; it then handles it as a failed group
  (stacks, stop, restart from a live peer with ``--max-restarts``).

When the job is stopped because of a hang, the supervisor takes every live rank's stacks before any SIGTERM. Stops
that are not hangs (a rank raised, was killed, or the job was preempted) take none, so restarts stay fast.
"""
from __future__ import annotations

import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

from fabriclite.supervision.processes.failures import Failure
from fabriclite.supervision.rank import progress as rank_progress
from fabriclite.supervision.rank.child import stacks_marker
from fabriclite.supervision.watch import stacks
from fabriclite.supervision.watch.progress_records import ProgressRecords
from fabriclite.supervision.watch.watcher import Event, RoundView

HANG_TIMEOUT_ENV = "FABRICLITE_HANG_TIMEOUT"
#: how long before the collective timeout a waiting rank's node takes a snapshot of its ranks' stacks (at most 30%
#: of the timeout)
SNAPSHOT_MARGIN_S = 5.0
_TIMEOUT_MARKERS = ("collectivetimeout", "timed out", "timeout")


def hang_timeout(default_s: float) -> float:
    """``$FABRICLITE_HANG_TIMEOUT`` (seconds; 0 turns the step watch off), else ``default_s``."""
    raw = os.environ.get(HANG_TIMEOUT_ENV)
    if raw in (None, ""):
        return default_s
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${HANG_TIMEOUT_ENV}={raw!r} is not a number of seconds; set it to e.g. 600, or 0 to turn "
                         "the optimizer-step hang watch off.") from None
    if value < 0:
        raise ValueError(f"${HANG_TIMEOUT_ENV}={raw!r} is negative; use 0 to turn the step watch off.")
    return value


def is_hang(failure: Failure) -> bool:
    """Whether ``failure`` is a rank reporting a collective timeout (fabriclite's or the backend's)."""
    if failure.secondary:
        return False
    text = f"{failure.error_line}\n{failure.traceback[-2000:]}".lower()
    return any(marker in text for marker in _TIMEOUT_MARKERS)


class HangWatch:
    """A watcher (supervision/watch/watcher.py): one node's view of its ranks' progress (``progress``: their
    records) and their stacks. ``observe`` returns a ``hang`` event that ends the round when the node is hung."""

    def __init__(self, node_rank: int, progress: ProgressRecords, timeout_s: float) -> None:
        self.node_rank = node_rank
        self.progress = progress
        self.timeout_s = hang_timeout(2 * timeout_s)
        self.collective_timeout_s = timeout_s
        #: --fault-tolerant (each node a replica group): a group whose ranks all wait on the others is not hung
        self.live = False
        #: a snapshot is taken this long into a wait (SNAPSHOT_MARGIN before the collective timeout fires)
        self._snapshot_after_s = timeout_s - min(SNAPSHOT_MARGIN_S, 0.3 * timeout_s)
        #: the stack section of the latest snapshot ("" if none), and the wait it was taken for
        self.snapshot = ""
        self._snapshot_of: Optional[float] = None
        #: the stack section taken in this round after a rank reported a collective timeout ("" if none)
        self.taken = ""

    # ------------------------------------------------------------------ per round
    def start_round(self, number: int) -> None:
        self.taken = self.snapshot = ""
        self._snapshot_of = None

    def stack_file(self, local_rank: int) -> str:
        return os.path.join(self.progress.tmpdir, f"stack-{self.progress.round}-{local_rank}.txt")

    def rank_env(self, local_rank: int, pythonpath: str) -> Dict[str, str]:
        """The round's rank ``local_rank``: the stack handler's bootstrap and file."""
        return stacks.rank_env(self.stack_file(local_rank), pythonpath)

    # ------------------------------------------------------------------ the watch
    def observe(self, view: RoundView) -> List[Event]:
        """A ``hang`` event (``reason``: why the node is hung, see :meth:`check`) that ends the round, or none."""
        reason = self.check(view)
        return [] if reason is None else [Event("hang", {"reason": reason}, ends_round=True)]

    def check(self, view: RoundView) -> Optional[str]:
        """Why the node is hung (no optimizer step by any of its ranks within the hang timeout), or None.

        Also takes a snapshot of the live ranks' stacks when a rank has waited on the others (a collective, or
        backward with its gradient all-reduce) for nearly the collective timeout: when the timeout fires, the
        backend breaks the others' connections and they start exiting, so stacks taken after it would show
        little; the snapshot shows where every rank was just before."""
        records = {r: rec for r, rec in view.records.items() if rec is not None}
        now = time.time()
        waits = [rec["waiting_since"] for rec in records.values() if rec.get("waiting_since")]
        if waits and self.collective_timeout_s and now - min(waits) >= self._snapshot_after_s \
                and self._snapshot_of != min(waits):
            self._snapshot_of = min(waits)
            self.snapshot = self.stacks(view.workers, f"a rank waited {now - min(waits):.1f} s on the others, "
                                                      f"{self.collective_timeout_s:g} s is the collective timeout")
        if not self.timeout_s:
            return None
        last = max((rec["last_step_time"] or 0.0 for rec in records.values()), default=0.0)
        if not last:
            return None  # armed by the first step: start-up, data loading and evaluation before it are not hangs
        idle = now - last
        if idle <= self.timeout_s:
            return None
        if all(rec["flags"] & rank_progress.FLAG_EXITING for rec in records.values()):
            return None  # every rank's script has ended: its exit is no hang
        if self.live and all(rec.get("waiting_since") for rec in records.values()):
            return None  # --fault-tolerant: every rank here waits on the other groups; the stuck one is elsewhere
        steps = max(rec["steps"] for rec in records.values())
        return (f"no rank of node {self.node_rank} completed an optimizer step for {idle:.0f} s (hang timeout "
                f"{self.timeout_s:g} s, ${HANG_TIMEOUT_ENV}); the last one was step {steps}")

    # ------------------------------------------------------------------ stacks
    def error_seen(self, local_rank: int, error_file: str, workers: Dict[int, Tuple[int, bool]],
                   failed: Sequence[int]) -> None:
        """Rank ``local_rank`` wrote ``error_file``: if it reports a collective timeout, take the live ranks' stacks
        now, while it waits for them (rank.child.wait_for_stacks) and the others are where it left them; then let
        it go. ``failed``: local ranks whose errors are known (their tracebacks are in the summary)."""
        failure = Failure.from_exit(self.node_rank, self.progress.global_rank(local_rank), local_rank, None, error_file)
        if is_hang(failure) and not self.taken:
            if self.snapshot:  # taken just before the timeout fired: where every rank was then
                self.taken = self.snapshot
            else:
                others = {r: (pid, alive and r not in failed and r != local_rank)
                          for r, (pid, alive) in workers.items()}
                self.taken = self.stacks(others, f"rank {failure.global_rank} reported a collective timeout")
        try:
            open(stacks_marker(error_file), "w").close()
        except OSError:
            pass

    def stacks(self, workers: Dict[int, Tuple[int, bool]], why: str, stuck: Sequence[int] = ()) -> str:
        """The stack section for the live ranks in ``workers`` (local rank -> (pid, alive)), taken now."""
        live = {self.progress.global_rank(r): (pid, self.stack_file(r)) for r, (pid, alive) in workers.items()
                if alive}
        taken = stacks.take(live)
        records = self.progress.read(list(workers))
        return stacks.format_stacks(taken, records, self.node_rank, why, stuck)
