"""Preemption, on the supervisor's side.

- The first SIGTERM or requeue signal (SIGUSR1 unless ``--requeue-signal`` / ``$FABRICLITE_REQUEUE_SIGNAL``
  says otherwise) to a supervisor marks the job preempted: the supervisor forwards the signal to its ranks
  (which record it: fabriclite/supervision/rank/signals.py) and gives them a grace period (``--preempt-grace``,
  ``$FABRICLITE_PREEMPT_GRACE``, default 20 s) to save and exit. When it is over, or on a second signal or a
  SIGINT, the ranks are stopped as after any failure.
- A preempted job is never restarted.
- Requeue: under SLURM, after the requeue signal, node 0's supervisor runs ``scontrol requeue <job>`` once its
  ranks have exited (``--no-requeue`` / ``$FABRICLITE_REQUEUE=0`` to opt out). After SIGTERM (plain ``scancel``,
  or the time limit without ``--signal``) the job is never requeued: SLURM is ending it.
- Exit code: 0 when every rank exited 0 and the job was requeued; otherwise 75 (EX_TEMPFAIL: "preempted,
  resumable"). A rank that fails during the grace period ends the job with that failure's code, as usual.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from fabriclite.environments.slurm import (REQUEUE_ENV, REQUEUE_SIGNAL_ENV, requeue, requeue_from_env,
                                          requeue_signal_from_env, slurm_job)

GRACE_ENV = "FABRICLITE_PREEMPT_GRACE"
__all__ = ["GRACE_ENV", "REQUEUE_ENV", "REQUEUE_SIGNAL_ENV", "DEFAULT_GRACE_S", "EXIT_PREEMPTED", "PreemptOptions",
           "Preemption", "parse_grace"]
DEFAULT_GRACE_S = 20.0
#: EX_TEMPFAIL: the job was preempted and can resume from its last checkpoint
EXIT_PREEMPTED = 75


def parse_grace(value: Any, where: str) -> float:
    """A grace period in seconds (>= 0, finite); ValueError naming ``where`` otherwise."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not 0 <= seconds < float("inf"):
        raise ValueError(f"{where}={value!r}: expected a number of seconds >= 0 (how long preempted ranks get to "
                         f"save and exit; default {DEFAULT_GRACE_S:g}).")
    return seconds


@dataclass
class PreemptOptions:
    grace_s: float = DEFAULT_GRACE_S
    requeue: bool = True
    requeue_signal: signal.Signals = signal.SIGUSR1

    @classmethod
    def from_env(cls) -> "PreemptOptions":
        raw = os.environ.get(GRACE_ENV)
        grace = parse_grace(raw, f"${GRACE_ENV}") if raw not in (None, "") else DEFAULT_GRACE_S
        return cls(grace, requeue_from_env(), requeue_signal_from_env())

    @property
    def signals(self) -> Tuple[signal.Signals, ...]:
        """The signals that start a grace period: SIGTERM and the requeue signal."""
        return tuple(dict.fromkeys((signal.SIGTERM, self.requeue_signal)))

    def child_env(self) -> Dict[str, str]:
        """What the ranks must know to record the same signal: ``$FABRICLITE_REQUEUE_SIGNAL``."""
        return {REQUEUE_SIGNAL_ENV: self.requeue_signal.name}


class Preemption:
    """One supervisor's preemption state (see the module docstring)."""

    def __init__(self, options: Optional[PreemptOptions] = None) -> None:
        self.options = options or PreemptOptions()
        self.signum: Optional[int] = None
        self.deadline = 0.0

    @property
    def active(self) -> bool:
        return self.signum is not None

    def notice(self, signum: int, workers: Dict[int, Any]) -> bool:
        """Called from the supervisor's signal handler: True when ``signum`` starts the grace period (the
        first SIGTERM / requeue signal; the signal is forwarded to the ranks still running), False when the ranks
        must be stopped now (a SIGINT, or a second signal)."""
        if signum not in self.options.signals or self.active:
            return False
        self.signum, self.deadline = signum, time.monotonic() + self.options.grace_s
        for worker in list(workers.values()):
            if worker.poll() is None:
                try:
                    os.kill(worker.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass
        return True

    def expired(self) -> bool:
        return self.active and time.monotonic() >= self.deadline

    def describe(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def expired_summary(self, node_rank: int) -> str:
        return (f"fabriclite: preempted ({self.describe()}): the ranks of node {node_rank} did not end within the "
                f"{self.options.grace_s:g} s grace period (--preempt-grace); stopped them.")

    def finish(self, code: int, node_rank: int) -> tuple:
        """The job's exit code and a last line for the summary, once the ranks have exited: requeue (node 0,
        SLURM, the requeue signal, not opted out), then 0 if every rank exited 0 and the job was requeued, else 75. Any
        other failure keeps its code."""
        if not self.active or code not in (0, EXIT_PREEMPTED):
            return code, ""
        requeued = False
        if self.signum == self.options.requeue_signal and node_rank == 0 and self.options.requeue and slurm_job():
            requeued = requeue()
        if code == 0 and requeued:
            return 0, ""
        return EXIT_PREEMPTED, (f"fabriclite: preempted ({self.describe()}); exit code {EXIT_PREEMPTED} (preempted, "
                                "resumable: start the same command again to continue from the last checkpoint).")
