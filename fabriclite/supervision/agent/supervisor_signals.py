"""The supervisor's own signals (installed for its run, in the main thread only): SIGINT stops every rank (exit code
130); SIGQUIT asks the watch loop for the ranks' live stacks, and the job goes on; the first SIGTERM / requeue signal
(SIGUSR1) is a preemption notice with a grace period (supervision/agent/preemption.py), a second one stops every rank
(128 + signal). A signal while the supervisor waits for node 0's store raises :class:`Interrupted` there."""
from __future__ import annotations

import signal
import threading
from typing import Any, Callable


class Interrupted(Exception):
    """A signal arrived while the supervisor waited for the job's store."""


def install(supervisor: Any) -> Callable[[], None]:
    """Install ``supervisor``'s handlers (they set its ``_signal`` / ``_dump_requested``); returns what restores the
    previous ones."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGQUIT, *supervisor.preemption.options.signals)}

    def handler(signum: int, frame: Any) -> None:
        if signum == signal.SIGQUIT:  # print the ranks' stacks (the watch loop takes them); the job goes on
            supervisor._dump_requested = True
            return
        if not supervisor._opening and supervisor.preemption.notice(signum, supervisor.ranks.workers):
            supervisor.record.preemption_notice(signum)
            return  # the first SIGTERM / requeue signal: a grace period (see supervision/agent/preemption.py)
        supervisor._signal = signum
        if supervisor._opening:  # waiting for node 0's store: stop waiting now
            raise Interrupted()

    for s in previous:
        signal.signal(s, handler)

    def restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h)

    return restore
