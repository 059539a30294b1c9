"""Restarts: when a rank fails, every node stops its ranks as usual, then the job starts all of them again,
up to ``max_restarts`` times (``fabriclite run --max-restarts N``, ``Fabric(max_restarts=N)``,
``$FABRICLITE_MAX_RESTARTS``).

- Rounds. Round 0 is the first start; each restart is the next round. Ranks learn theirs from
  ``$FABRICLITE_RESTART_COUNT`` (``fabric.restart_count``) and meet in that round's own part of the job's store
  (``control_plane.meeting.round_store``), so no rank of an old round can join a new one (and old rounds' ranks are all
  reaped before a new round starts anyway).
- Agreement. After a failed round every node's supervisor reports, in the job's store, whether it can go on
  (it cannot after a signal or a preemption); node 0's supervisor decides for the job (restarts left, the
  ``--restart-window`` not over, every node able) and publishes the decision with the next round's delay. A
  node that does not report within AGREE_S ends the job (the protocol: control_plane/restart_agreement.py).
- Backoff: the first restart is immediate (most failures are one-off: a lost node, a killed rank); later ones back
  off, 1 s before the second restart, doubling, at most 30 s, so that a crash loop does not spin.
  ``$FABRICLITE_RESTART_BACKOFF`` sets the delay before the second restart (the base of the doubling) and
  ``$FABRICLITE_FIRST_RESTART_BACKOFF`` the delay before the first (default 0).
- Reporting: each failure's summary is printed when it happens, with what comes next; the final summary lists
  every round. When the restarts are used up the job fails with the last failure's exit code, naming it.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

from fabriclite.distributed import rendezvous
from fabriclite.distributed.control_plane import restart_agreement

MAX_RESTARTS_ENV = "FABRICLITE_MAX_RESTARTS"
WINDOW_ENV = "FABRICLITE_RESTART_WINDOW"
BACKOFF_ENV = "FABRICLITE_RESTART_BACKOFF"
FIRST_BACKOFF_ENV = "FABRICLITE_FIRST_RESTART_BACKOFF"
MAX_BACKOFF_S = 30.0


def parse_max_restarts(value: Any, where: str = "max_restarts") -> int:
    """``value`` (an int, or a string of digits) as an int >= 0; ValueError naming ``where`` otherwise."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{where}={value!r}: expected a whole number >= 0 (how many times to restart the job "
                         "after a failure).")
    return value


def parse_seconds(value: Any, where: str, allow_zero: bool = True) -> float:
    """``value`` as a finite number of seconds >= 0 (> 0 without ``allow_zero``); ValueError naming ``where``."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not (seconds >= 0 and seconds != float("inf")) or (seconds == 0 and not allow_zero):
        raise ValueError(f"{where}={value!r}: expected a number of seconds >= 0{'' if allow_zero else ' (not 0)'}.")
    return seconds


def resolve_max_restarts(value: Optional[int]) -> int:
    """``Fabric(max_restarts=...)`` against ``$FABRICLITE_MAX_RESTARTS`` (set by the user, or by the supervisor
    for its ranks): the env fills a value the code left None; a different explicit value is a ValueError (it
    cannot take effect once the supervisor runs)."""
    raw = os.environ.get(MAX_RESTARTS_ENV)
    env = parse_max_restarts(raw, f"${MAX_RESTARTS_ENV}") if raw not in (None, "") else None
    if value is None:
        return env or 0
    value = parse_max_restarts(value)
    if env is not None and env != value:
        raise ValueError(f"Fabric(max_restarts={value}) differs from {MAX_RESTARTS_ENV}={raw} that the supervisor "
                         "(`fabriclite run --max-restarts` or the environment) was started with; it cannot take "
                         "effect. Pass the value in one place only.")
    return value


#: Where restarts are counted, each by whoever restarted the job: fabriclite's rounds (this allocation's
#: supervisor), SLURM's requeues of this job, torchrun's restarts (per agent: an agent that joins late starts at 0)
RESTART_COUNTERS = (rendezvous.ROUND_ENV, "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")


def restart_count() -> int:
    """This process's count of restarts: the sum of ``$FABRICLITE_RESTART_COUNT`` (fabriclite's round in this
    allocation), ``$SLURM_RESTART_COUNT`` (SLURM's requeues of this job) and ``$TORCHELASTIC_RESTART_COUNT``
    (torchrun's restarts, as this rank's agent counts them); 0 where none is set. A value that is not a whole
    number is a ValueError naming it. ``fabric.restart_count`` is this value agreed over the job at launch
    (:func:`agree_restart_count`)."""
    total = 0
    for name in RESTART_COUNTERS:
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        if not raw.isdigit():
            raise ValueError(f"{name}={raw!r} is not a whole number >= 0 (a count of restarts); unset it or fix "
                             "whatever set it.")
        total += int(raw)
    return total


def needs_agreement() -> bool:
    """Whether ranks of one job may count restarts differently: only under torchrun, whose agents count their own
    (one that joined late starts at 0). fabriclite's rounds and SLURM's requeue count are the same on every rank."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def agree_restart_count(strategy: Any) -> int:
    """:func:`restart_count`, the same on every rank: the maximum over the job (one all_reduce of one number, at
    launch, only where :func:`needs_agreement`; a collective: every rank calls it)."""
    local = restart_count()
    if strategy.world_size == 1 or not needs_agreement():
        return local
    import torch

    tensor = torch.tensor([float(local)], device=strategy.root_device)
    return int(strategy.flat_all_reduce(tensor, "max", None)[0].item())


@dataclass
class RestartPolicy:
    """How often, and for how long, a failed job is started again."""

    max_restarts: int = 0
    window_s: Optional[float] = None
    #: the delay before the second restart, doubled for each one after it
    backoff_s: float = 1.0
    #: the delay before the first restart
    first_backoff_s: float = 0.0

    @classmethod
    def from_env(cls, max_restarts: int) -> "RestartPolicy":
        """``max_restarts`` with ``$FABRICLITE_RESTART_WINDOW``, ``$FABRICLITE_RESTART_BACKOFF`` and
        ``$FABRICLITE_FIRST_RESTART_BACKOFF`` (ValueError naming a bad one)."""
        window, backoff, first = (os.environ.get(name) for name in (WINDOW_ENV, BACKOFF_ENV, FIRST_BACKOFF_ENV))
        return cls(max_restarts, parse_seconds(window, f"${WINDOW_ENV}") if window else None,
                   parse_seconds(backoff, f"${BACKOFF_ENV}") if backoff else 1.0,
                   parse_seconds(first, f"${FIRST_BACKOFF_ENV}") if first else 0.0)

    def backoff(self, restart: int) -> float:
        """The delay before restart number ``restart`` (0 first): ``first_backoff_s`` (default 0: immediate), then
        ``backoff_s`` doubling, at most MAX_BACKOFF_S."""
        if restart == 0:
            return min(MAX_BACKOFF_S, self.first_backoff_s)
        return min(MAX_BACKOFF_S, self.backoff_s * (2 ** (restart - 1)))


@dataclass
class Round:
    number: int
    started: float
    ended: float = 0.0
    code: Optional[int] = None
    what: str = ""


@dataclass
class History:
    """Every round of the job, for the final summary."""

    policy: RestartPolicy
    started: float = field(default_factory=time.monotonic)
    rounds: List[Round] = field(default_factory=list)

    def table(self) -> str:
        used = len(self.rounds) - 1
        lines = [f"fabriclite: {len(self.rounds)} rounds ({used} of {self.policy.max_restarts} restarts used):"]
        for r in self.rounds:
            outcome = "succeeded" if r.code == 0 else (r.what or f"failed with exit code {r.code}")
            lines.append(f"  round {r.number}: {outcome} ({r.ended - r.started:.1f} s)")
        return "\n".join(lines)


def first_line(summary: str) -> str:
    """What failed, from a supervisor's summary ("rank 1 (local rank 1, node 0) was killed by SIGKILL")."""
    line = summary.strip().splitlines()[0] if summary.strip() else "failed"
    for prefix in ("fabriclite: the job failed: ", "fabriclite: "):
        if line.startswith(prefix):
            return line[len(prefix):].rstrip(".")
    return line


def run_rounds(supervisor: Any, play: Callable[[int], int], report: Callable[[str], None]) -> int:
    """Play rounds (``play(round)`` starts, watches and stops the node's ranks, returning the round's code and
    leaving its summary in ``supervisor.summary``) until one succeeds, the job cannot go on, or the restarts are
    used up. Returns the job's exit code; ``supervisor.summary`` becomes the final summary."""
    policy: RestartPolicy = supervisor.restarts
    history = History(policy)
    number = 0
    while True:
        current = Round(number, time.monotonic())
        history.rounds.append(current)
        code = play(number)
        current.ended, current.code = time.monotonic(), code
        if code != 0:
            current.what = f"failed: {first_line(supervisor.summary)}"
        if code == 0 or not policy.max_restarts:
            if number > 0:
                supervisor.summary = "\n".join(s for s in (supervisor.summary, history.table()) if s)
            return code
        able = supervisor.can_restart()
        delay = _agree(supervisor, number, able, history)
        if delay is None:
            reason = _why_not(supervisor, number, able, history)
            supervisor.summary = (f"{supervisor.summary}\n{history.table()}\nfabriclite: not restarting: {reason}; the "
                                  f"job failed, last failure: {first_line(supervisor.summary)}.")
            return supervisor.stopped_code(code)
        when = f"in {delay:g} s" if delay else "now"
        report(f"{supervisor.summary}\nfabriclite: restarting every rank {when} (round {number + 1}, restart "
               f"{number + 1} of {policy.max_restarts}).")
        time.sleep(delay)  # the backoff itself, not a synchronisation
        if not supervisor.can_restart():  # a signal or a preemption notice during the backoff
            supervisor.summary = (f"{history.table()}\nfabriclite: not restarting: the job was interrupted or "
                                  f"preempted during the backoff; last failure: {first_line(supervisor.summary)}.")
            return supervisor.stopped_code(code)
        number += 1


def _why_not(supervisor: Any, number: int, able: bool, history: History) -> str:
    policy = history.policy
    if not able:
        return "the job was interrupted or preempted"
    if number >= policy.max_restarts:
        return f"the {policy.max_restarts} restarts (--max-restarts) are used up"
    if policy.window_s is not None:
        return f"the restart window of {policy.window_s:g} s (--restart-window) is over"
    return "another node cannot go on"


def _allowed(history: History, number: int) -> Optional[float]:
    policy = history.policy
    if number >= policy.max_restarts:
        return None
    delay = policy.backoff(number)
    if policy.window_s is not None and time.monotonic() - history.started + delay > policy.window_s:
        return None
    return delay


def _agree(supervisor: Any, number: int, able: bool, history: History) -> Optional[float]:
    """The delay before the next round, the same on every node, or None to stop (see the module docstring)."""
    if supervisor.layout.num_nodes == 1:
        return _allowed(history, number) if able else None
    return restart_agreement.agree(supervisor.raw_store, number, supervisor.layout.node_rank,
                                   supervisor.layout.num_nodes, able, lambda: _allowed(history, number))
