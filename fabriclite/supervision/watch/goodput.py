"""Goodput: the share of a run's wall time spent in optimizer steps that counted, and the badput by cause, each part
measured from its own events (supervision/watch/events.py), not taken as a remainder. The vocabulary follows Google's
``ml-goodput-measurement`` where it fits (goodput, badput, wasted progress from disruption, unproductive checkpoint
time); "other" is what no event explains (store opening, ranks' exits).

- **wall**: each launch's ``job_start`` to its ``job_end``, summed over the launches of the run (requeues).
- **goodput**: each round's steps, from the end of its first step to its last step (``ranks_up`` ..
  ``round_end.last_step``), less the redone part and the checkpoint stalls inside it.
- **start-up**: ``job_start`` to the first ``round_start``, and each round's ``round_start`` to ``ranks_up`` (its
  first step done: imports, rendezvous, set-up, data loading, the first step itself).
- **restart**: from a failed round's ``failure`` to the next ``round_start`` (stopping the ranks, the backoff).
- **redone steps** (wasted progress): in a round that failed and was restarted, the steps after its last
  ``checkpoint`` (or after its first step when it saved none), from that checkpoint to its last step; none when
  the next round healed from a live peer (``restore`` from ``<live peer>``, ``--fault-tolerant``).
- **checkpoint stalls**: the ``blocked`` time of every ``checkpoint``.
- **preemption**: from a ``preemption_notice`` to the end of that round.

When node 0 prints the line (``fabriclite run --goodput``, ``$FABRICLITE_GOODPUT``): ``auto`` (the default) when
something cost the run time (a failure, restart, preemption, requeue, hang or straggler among its events) or it ran
longer than LONG_RUN_S; ``always``; ``never``.
"""
from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from fabriclite.supervision.watch import events as events_mod
from fabriclite.supervision.watch.watcher import Event, RoundView

GOODPUT_ENV = "FABRICLITE_GOODPUT"
GOODPUT_MODES = ("auto", "always", "never")
#: under ``auto``, a run this long (wall seconds over its launches) gets its line even when nothing went wrong
LONG_RUN_S = 600.0
#: under ``auto``, events that cost a run time: any of them gets the run its line
COSTLY_EVENTS = ("failure", "restart", "preemption_notice", "requeue", "hang", "straggler")
PARTS = ("startup", "restart", "redone", "checkpoint", "preemption")
_LABELS = {"startup": "start-up", "restart": "restart", "redone": "redone steps", "checkpoint": "checkpoint stalls",
           "preemption": "preemption"}


@dataclass
class Goodput:
    """Seconds: ``wall``, ``good``, each badput part in ``badput`` (keys :data:`PARTS`), ``redone_steps``."""

    wall: float = 0.0
    good: float = 0.0
    badput: Dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PARTS})
    redone_steps: int = 0

    @property
    def other(self) -> float:
        return max(0.0, self.wall - self.good - sum(self.badput.values()))

    def line(self, where: str = "") -> str:
        share = 100.0 * self.good / self.wall if self.wall > 0 else 0.0
        parts = ", ".join(f"{_LABELS[p]} {self.badput[p]:.1f} s" + (f" ({self.redone_steps} steps)"
                                                                     if p == "redone" else "") for p in PARTS)
        return (f"fabriclite: goodput {share:.1f}% ({self.good:.1f} s of {self.wall:.1f} s in steps that counted); "
                f"badput: {parts}, other {self.other:.1f} s" + (f" (events: {where})" if where else ""))


def parse_goodput(value: Any, where: str) -> str:
    """``value`` as one of GOODPUT_MODES; ValueError naming ``where`` and the choices otherwise."""
    mode = str(value).strip().lower()
    if mode not in GOODPUT_MODES:
        raise ValueError(f"{where}={value!r}: expected one of {', '.join(GOODPUT_MODES)} (when to print the goodput "
                         "line: auto prints it when something cost the run time or it ran over 10 minutes).")
    return mode


def goodput_from_env() -> str:
    """``$FABRICLITE_GOODPUT`` (default ``auto``); ValueError naming a bad value."""
    raw = os.environ.get(GOODPUT_ENV, "")
    return parse_goodput(raw, f"${GOODPUT_ENV}") if raw.strip() else "auto"


def worth_a_line(records: List[Dict[str, Any]], result: "Goodput") -> bool:
    """Under ``auto``: whether the run's ``records`` show something that cost it time, or ``result`` a run longer
    than LONG_RUN_S."""
    return result.wall > LONG_RUN_S or any(e.get("event") in COSTLY_EVENTS for e in records)


def measure(records: List[Dict[str, Any]]) -> Goodput:
    """Goodput of one node's events of one run (see the module docstring)."""
    result = Goodput()
    start: Optional[float] = None
    first_round_start: Optional[float] = None
    rounds: Dict[tuple, Dict[str, Any]] = {}
    launch = -1
    pending_failure: Optional[float] = None
    notice: Optional[float] = None
    for e in sorted(records, key=lambda r: r["time"]):
        kind, t = e.get("event"), float(e["time"])
        if kind == "job_start":
            start, first_round_start, launch, pending_failure, notice = t, None, launch + 1, None, None
        elif kind == "job_end" and start is not None:
            result.wall += t - start
            if notice is not None:
                result.badput["preemption"] += t - notice
                notice = None
            start = None
        elif kind == "round_start":
            if first_round_start is None and start is not None:
                first_round_start = t
                result.badput["startup"] += t - start
            if pending_failure is not None:
                result.badput["restart"] += t - pending_failure
                pending_failure = None
            rounds[(launch, e.get("round", 0))] = {"start": t, "checkpoints": [], "blocked": []}
        elif kind == "ranks_up":
            r = rounds.get((launch, e.get("round", 0)))
            if r is not None:
                r["up"] = float(e.get("first_step") or t)
                result.badput["startup"] += r["up"] - r["start"]
        elif kind == "restore":
            r = rounds.get((launch, e.get("round", 0)))
            if r is not None and e.get("source") == "<live peer>":
                r["healed"] = True  # --fault-tolerant: the state came from a live peer, nothing is redone
        elif kind == "checkpoint":
            result.badput["checkpoint"] += float(e.get("blocked", 0.0))
            r = rounds.get((launch, e.get("round", 0)))
            if r is not None:
                r["checkpoints"].append((t, int(e.get("step", 0))))
                r["blocked"].append((t, float(e.get("blocked", 0.0))))
        elif kind == "failure":
            pending_failure = t
            r = rounds.get((launch, e.get("round", 0)))
            if r is not None:
                r["failed"] = True
        elif kind == "preemption_notice":
            notice = t
        elif kind == "round_end":
            r = rounds.get((launch, e.get("round", 0)))
            if r is None:
                continue
            if notice is not None:
                result.badput["preemption"] += t - notice
                notice = None
            up, last = r.get("up"), e.get("last_step")
            if up is None or not last:
                continue
            span = max(0.0, float(last) - up)
            stalls = sum(b for when, b in r["blocked"] if up <= when <= float(last) + 1e-3)
            redone = 0.0
            if r.get("failed") or e.get("exit_code", 0) != 0:
                r["redo"] = (float(last), int(e.get("steps", 0)), r["checkpoints"])
                saved = [c for c in r["checkpoints"] if c[0] <= float(last)]
                since, step = (saved[-1][0], saved[-1][1]) if saved else (up, 1)
                redone = max(0.0, float(last) - since)
                r["redone"] = (redone, max(0, int(e.get("steps", 0)) - step))
            r["good"] = max(0.0, span - stalls - redone)
        elif kind == "restart":
            pass  # the restart's time is measured from the failure to the next round_start
    # redone work counts only where a round came after it (a restart); a last failed round's work is simply lost
    ordered = sorted(rounds.items(), key=lambda kv: kv[1]["start"])
    for index, (_, r) in enumerate(ordered):
        good = r.get("good", 0.0)
        if "redone" in r:
            redone, steps = r["redone"]
            if index + 1 < len(ordered) and not ordered[index + 1][1].get("healed"):
                result.badput["redone"] += redone
                result.redone_steps += steps
            else:
                good += 0.0
        result.good += good
    if start is not None:  # a launch still running (the line is printed before job_end is written)
        result.wall += time.time() - start
        if notice is not None:
            result.badput["preemption"] += time.time() - notice
    return result


def _env_count(name: str) -> Optional[int]:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() else None


class RanksUp:
    """A watcher (supervision/watch/watcher.py): one ``ranks_up`` event per round, once every rank of the node has
    finished its first optimizer step (``first_step``: when the slowest did, ``seconds``: since the round's
    start); the goodput's start-up part ends there."""

    def __init__(self) -> None:
        self.round = 0
        #: the end of the slowest rank's first step in the round being played (None before)
        self.first_step: Optional[float] = None
        self._started: Optional[float] = None

    def start_round(self, number: int) -> None:
        self.round, self.first_step, self._started = number, None, time.time()

    def observe(self, view: RoundView) -> List[Event]:
        records = view.records
        if self.first_step is not None or not records or any(r is None or not r["steps"] for r in records.values()):
            return []
        # the end of the slowest rank's first step (the record's own time: the supervisor reads it up to 0.5 s late)
        self.first_step = max(r["first_step_time"] or r["last_step_time"] for r in records.values() if r)
        seconds = round(self.first_step - self._started, 4) if self._started else None
        return [Event("ranks_up", {"round": self.round, "first_step": self.first_step, "seconds": seconds})]


class JobRecord:
    """A supervisor's events (one node): what the supervisor calls, in order. None-safe when events are off."""

    def __init__(self, node_rank: int, run_id: str, log_dir: Optional[str], ranks: int) -> None:
        self.log = events_mod.for_supervisor(node_rank, run_id, log_dir)
        self.node_rank, self.ranks = node_rank, ranks
        self._round = 0

    def emit(self, event: str, **fields: Any) -> None:
        if self.log is not None:
            self.log.emit(event, **fields)

    def rank_env(self) -> Dict[str, str]:
        return {events_mod.EVENTS_FILE_ENV: os.path.abspath(self.log.path)} if self.log is not None else {}

    def job_start(self) -> None:
        """``job_start``, with the command that started this supervisor and its engine (SLURM, torchrun)."""
        slurm_job = os.environ.get("SLURM_JOB_ID")
        slurm, torchrun = _env_count("SLURM_RESTART_COUNT"), _env_count("TORCHELASTIC_RESTART_COUNT")
        self.emit("job_start", launch=slurm or torchrun or 0, ranks=self.ranks, pid=os.getpid(),
                  command=list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]),
                  host=socket.gethostname(), slurm_job_id=slurm_job, slurm_restart_count=(slurm or 0) if slurm_job
                  else None, torchrun_restart_count=torchrun)

    def round_start(self, number: int, backoff: Optional[float]) -> None:
        if number > 0:
            self.emit("restart", round=number, backoff=backoff)
        self._round = number
        self.emit("round_start", round=number)

    def failure(self, rank: Optional[int], cause: str, exit_code: int, hang: bool) -> None:
        self.emit("failure", round=self._round, rank=rank, cause=cause.splitlines()[0][:500] if cause else "",
                  exit_code=exit_code, hang=hang)

    def hang(self, reason: str, stacks: str) -> None:
        self.emit("hang", round=self._round, reason=reason, stacks=stacks)

    def round_end(self, exit_code: int, records: Dict[int, Optional[dict]], first_step: Optional[float]) -> None:
        """``records``: the ranks' last progress records; ``first_step``: the round's ``ranks_up`` time (None)."""
        seen = [r for r in records.values() if r]
        self.emit("round_end", round=self._round, exit_code=exit_code, steps=max((r["steps"] for r in seen), default=0),
                  first_step=first_step,
                  last_step=max((r["last_step_time"] or 0.0 for r in seen), default=0.0) or None)

    def preemption_notice(self, signum: int) -> None:
        self.emit("preemption_notice", signal=signum)

    def job_end(self, exit_code: int, requeued: bool, mode: str = "auto") -> Optional[str]:
        """Write ``job_end``; on node 0, the goodput line over the run's events so far when ``mode`` says to print it
        (see the module docstring; None elsewhere, or when not)."""
        if requeued:
            self.emit("requeue", exit_code=exit_code)
        self.emit("job_end", exit_code=exit_code)
        if self.log is None or self.node_rank != 0:
            return None
        if mode == "never":
            return None
        try:
            found = events_mod.read(self.log.path, self.log.run_id)
        except OSError:
            return None
        result = measure(found)
        return result.line(self.log.path) if mode == "always" or worth_a_line(found, result) else None

    @property
    def folder(self) -> Optional[str]:
        """The folder of this node's events record (None when the record is off)."""
        return os.path.dirname(os.path.abspath(self.log.path)) if self.log is not None else None
