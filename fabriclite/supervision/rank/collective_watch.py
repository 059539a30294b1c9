"""Collective progress: how many collectives each rank has entered, so that a collective that
times out or loses a peer fails with one clear error naming the ranks that did not arrive.

Each rank counts the collectives it enters (a Python int per process group: no store traffic per
collective). A daemon thread publishes the counts to the job's store once per ``interval`` seconds (by default
``collective_progress.publish_interval`` of the collective timeout).
When a collective fails, :meth:`CollectiveWatch.failed` reads every member's counts and builds the
error; the process group is unusable afterwards (every later collective raises at once).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from fabriclite.distributed.control_plane import collective_progress, failure_flag
from fabriclite.supervision.rank import progress as rank_progress
from fabriclite.supervision.rank.child import PEER_LOST_MARKERS, SUPERVISOR_PID_ENV

#: after a lost peer, how long to wait for the supervisor to report which rank failed
SUPERVISOR_REPORT_WAIT_S = 2.0
_TIMEOUT_MARKERS = ("timed out", "timeout")
FATAL_ADVICE = ("A collective timeout or a lost rank is fatal for the process group: every later collective "
                "fails; end the job and restart it (from a checkpoint).")


class CollectiveError(RuntimeError):
    """A collective failed and the process group is unusable. ``collective`` ("all_reduce"),
    ``number`` (1-based count of collectives this rank entered on that group), ``group`` (its
    global ranks), ``missing`` (ranks known not to have arrived). ``secondary``: the error only
    reports that another rank is gone (the job's root cause is elsewhere)."""

    secondary = False

    def __init__(self, message: str, collective: str = "", number: int = 0, group: Sequence[int] = (),
                 missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.collective = collective
        self.original: Optional[BaseException] = None
        self.number = number
        self.group = list(group)
        self.missing = list(missing)


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A collective did not complete within the timeout."""


class PeerLost(CollectiveError):
    """A collective failed because another rank of the group is gone."""

    secondary = True


class CollectiveWatch:
    """Counts this rank's collectives per process group and explains their failures.

    ``store``: the job's store (keys under control_plane.keys.PREFIX); ``publish_store``: a second client for the
    publishing thread (default: ``store``). ``timeout``: the process group's timeout, in seconds.
    """

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float,
                 publish_store: Any = None, interval: Optional[float] = None) -> None:
        self.store = store
        self.rank = rank
        self.world = tuple(range(world_size))
        self.timeout_s = timeout_s
        self.interval = collective_progress.publish_interval(timeout_s) if interval is None else interval
        self.counts: Dict[Tuple[int, ...], int] = {}
        self.names: Dict[Tuple[int, ...], str] = {}
        self.broken: Optional[str] = None
        self._keys: Dict[Any, Tuple[int, ...]] = {}
        self._publish_store = publish_store if publish_store is not None else store
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        #: the supervisor's view of this rank (collective entered / finished), or None
        self._progress = rank_progress.progress()

    # ------------------------------------------------------------------ hot path
    def enter(self, name: str, group: Any, group_ranks: Any) -> Tuple[Tuple[int, ...], int]:
        """Count one collective ``name`` on ``group``; returns (group key, its number). Raises the
        group's first error again if the group is already broken. ``group_ranks(group)`` gives a
        group's global ranks (called once per group)."""
        if self.broken is not None:
            raise PeerLost(f"fabriclite: {name} cannot run: the process group is unusable since an earlier "
                           f"collective failed ({self.broken}). {FATAL_ADVICE}", name)
        if group is None:
            key = self.world
        else:
            key = self._keys.get(group)  # type: ignore[assignment]
            if key is None:
                key = self._keys[group] = tuple(group_ranks(group))
        number = self.counts[key] = self.counts.get(key, 0) + 1
        self.names[key] = name
        if self._progress is not None:
            self._progress.collective_entered(name, number)
        return key, number

    def mark_nccl(self) -> None:
        """Tell the supervisor this rank's process group is NCCL's."""
        if self._progress is not None:
            self._progress.set_flags(rank_progress.FLAG_NCCL)

    def finished(self, name: str, number: int) -> None:
        """Collective ``name`` #``number`` (from ``enter``) completed on this rank."""
        if self._progress is not None:
            self._progress.collective_finished(name, number)

    # ------------------------------------------------------------------ publishing
    def start(self) -> None:
        """Start publishing this rank's counts every ``interval`` seconds (daemon thread)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._publish_loop, name="fabriclite-progress", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop publishing; returns within about a second."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None

    def _publish_loop(self) -> None:
        while not self._stop.wait(self.interval):
            if not self._publish(left=False):
                return
        self._publish(left=True)  # this rank leaves the group: say so, with its last counts

    def _publish(self, left: bool) -> bool:
        record = {"counts": {_label(k): [n, self.names.get(k, "")] for k, n in list(self.counts.items())},
                  "time": time.time(), "left": left}
        try:
            collective_progress.publish(self._publish_store, self.rank, record)
            return True
        except RuntimeError:  # the store is gone: the supervisor is ending the job
            return False

    # ------------------------------------------------------------------ failures
    def failed(self, name: str, key: Tuple[int, ...], number: int, err: BaseException) -> Optional[CollectiveError]:
        """The clear error for collective ``name`` #``number`` on group ``key`` that raised ``err``,
        or None when ``err`` is not a timeout or a lost peer (it is then the caller's to re-raise).
        Marks the group broken. The backend's own error is kept as ``.original``."""
        text = str(err).lower()
        if any(m in text for m in _TIMEOUT_MARKERS):
            error: CollectiveError = self._timed_out(name, key, number)
        elif any(m in text for m in PEER_LOST_MARKERS):
            error = self._peer_lost(name, key, number, err)
        else:
            return None
        error.original = err
        self.broken = f"{_what(name, key, number, self.world)}: {type(error).__name__}"
        return error

    def _timed_out(self, name: str, key: Tuple[int, ...], number: int) -> CollectiveTimeout:
        what = _what(name, key, number, self.world)
        behind = self._behind(key, number)
        head = f"fabriclite: {what} timed out after {self.timeout_s:g} s on rank {self.rank}"
        if behind is None:
            detail = "(the other ranks' progress could not be read from the job's store)"
        elif behind:
            detail = (f"ranks {[r for r, _ in behind]} did not arrive "
                      f"({'; '.join(f'rank {r}: {desc}' for r, desc in behind)})")
        else:
            detail = ("every rank of the group entered it: one is stuck inside it, or the ranks called different "
                      "collectives (or shapes) at this point")
        message = f"{head}: {detail}. {FATAL_ADVICE} If the ranks are only slow, raise the timeout " \
                  f"(DDPStrategy(timeout=...), $FABRICLITE_TIMEOUT or `fabriclite run --timeout`)."
        return CollectiveTimeout(message, name, number, key, [r for r, _ in behind or []])

    def _peer_lost(self, name: str, key: Tuple[int, ...], number: int, err: BaseException) -> PeerLost:
        what = _what(name, key, number, self.world)
        report = self._supervisor_report()
        if report:
            cause = f"the job's supervisor reports: {report}"
        else:
            behind = self._behind(key, number)
            cause = f"({err})"
            if behind:
                cause = (f"ranks {[r for r, _ in behind]} had not entered it "
                         f"({'; '.join(f'rank {r}: {desc}' for r, desc in behind)}) {cause}")
        message = f"fabriclite: {what} failed on rank {self.rank}: another rank of the group is gone; {cause}. " \
                  f"{FATAL_ADVICE}"
        return PeerLost(message, name, number, key)

    def _supervisor_report(self) -> Optional[str]:
        if SUPERVISOR_PID_ENV not in os.environ:
            return None
        deadline = time.monotonic() + SUPERVISOR_REPORT_WAIT_S
        while True:
            record = failure_flag.read_failure(self.store)
            if record is not None:
                return failure_flag.describe_failure(record)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _behind(self, key: Tuple[int, ...], number: int) -> Optional[List[Tuple[int, str]]]:
        """Ranks of ``key`` whose published count is below ``number``, each with a description."""
        label = _label(key)
        behind: List[Tuple[int, str]] = []
        try:
            for r in key:
                if r == self.rank:
                    continue
                record = collective_progress.read(self.store, r) or {"counts": {}, "time": None}
                count, last = record["counts"].get(label, [0, ""])
                if count >= number:
                    continue
                desc = f"last collective #{count} ({last})" if count else "no collective reported yet"
                age = time.time() - record["time"] if record["time"] is not None else None
                if record.get("left"):
                    desc = f"left the group after collective #{count}" if count else "left the group"
                elif age is not None and age > 3 * self.interval:
                    desc += f", silent for {age:.0f} s"
                behind.append((r, desc))
        except (RuntimeError, ValueError, KeyError, TypeError):
            return None
        return behind


def _label(key: Tuple[int, ...]) -> str:
    return ",".join(map(str, key))


def _what(name: str, key: Tuple[int, ...], number: int, world: Tuple[int, ...]) -> str:
    return f"{name} #{number}" + ("" if key == world else f" on group {list(key)}")
