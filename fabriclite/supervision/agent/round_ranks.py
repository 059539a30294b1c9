"""One round's ranks on one node, as its supervisor handles them: started (the launcher's ``start`` decides how: a
new process, or a warm spare it hands over), polled for their ending, stopped and reaped; and the moment the round
is up (every rank here finished its first optimizer step), when the launcher's ``when_up`` runs once (warm spares
are started then: started beside the round's start they would slow it; launchers/warm_spare.py).
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any, Callable, Dict, List, Optional, Set

from fabriclite.supervision.processes.failures import Failure
from fabriclite.supervision.watch.hangs import HangWatch
from fabriclite.supervision.agent.node_layout import NodeLayout, Worker
from fabriclite.supervision.processes.stopping import kill_group, reap

POLL_S = 0.05
#: how long to wait for the root cause while only ranks that lost a peer were seen failing and a rank of this node is
#: still running: the rank that went away is exiting, which can take its teardown's 2 s bound on gloo's workers plus a
#: loaded interpreter's exit (at 1 s, a load-20 run named the lost-peer rank as the cause; at 5 s, a loaded CI run
#: named it too). The wait ends as soon as every rank here has ended, a real cause is seen, or another node
#: published one; the bound only holds for a rank that neither exits nor fails.
SECONDARY_WAIT_S = 30.0
#: how long a rank that raised may take to exit by itself before it counts as failed, and what it gets beyond the
#: grace after SIGTERM (it is exiting already; its teardown may wait up to 2 s for gloo's workers: gloo_exit)
RAISED_GRACE_S, EXITING_S = 0.25, 2.0
#: a round whose ranks report no optimizer step (a script that steps no fabric optimizer) counts as up this long
#: after its start
UP_WITHOUT_STEPS_S = 60.0


class RoundRanks:
    """This node's ranks of the round being played: ``workers`` (local rank -> Worker), ``raised_at`` (local ranks
    whose error file appeared, and when), ``finished`` (global ranks that exited 0)."""

    def __init__(self, layout: NodeLayout, hangs: HangWatch, error_file: Callable[[int], str]) -> None:
        self.layout, self.hangs, self.error_file = layout, hangs, error_file
        self.workers: Dict[int, Worker] = {}
        self.raised_at: Dict[int, float] = {}
        self.finished: List[int] = []
        self._stopped: Set[int] = set()
        self._up = True
        self._started = 0.0

    def start(self, start: Callable[[int, Dict[str, str]], Worker], env: Callable[[int], Dict[str, str]],
              reaper: Any) -> None:
        """A new round: ``start(local_rank, env(local_rank))`` for every local rank, each watched by ``reaper``."""
        self.workers, self.raised_at, self.finished = {}, {}, []
        self._up, self._started = False, time.monotonic()
        for local_rank in range(self.layout.local_world_size):
            worker = self.workers[local_rank] = start(local_rank, env(local_rank))
            reaper.watch(worker.pid)  # each rank leads its own process group

    def check_up(self, records: Dict[int, Optional[dict]], when_up: Optional[Callable[[], None]]) -> None:
        """Run ``when_up`` once in the round, as soon as ``records`` (the ranks' progress) show every rank here past
        its first optimizer step (or UP_WITHOUT_STEPS_S after the round's start)."""
        if self._up or when_up is None:
            return
        stepped = len(records) == len(self.workers) and all(r is not None and r["steps"] for r in records.values())
        if stepped or time.monotonic() - self._started > UP_WITHOUT_STEPS_S:
            self._up = True
            when_up()

    def live(self, failed: Set[int] = frozenset()) -> Dict[int, Any]:  # type: ignore[assignment]
        """Local rank -> (pid, alive and not in ``failed``)."""
        return {r: (w.pid, w.poll() is None and r not in failed) for r, w in self.workers.items()}

    def poll(self, running: Dict[int, Worker], failures: List[Failure]) -> None:
        """Move ranks that ended, or that raised (their error file exists) and are still exiting
        after RAISED_GRACE_S (an interpreter with torch takes a second or more to exit), from
        ``running`` to ``failures`` (exit 0 is no failure)."""
        now = time.monotonic()
        for local_rank, worker in list(running.items()):
            code = worker.poll()
            if code is None:
                if local_rank not in self.raised_at:
                    if os.path.exists(self.error_file(local_rank)):
                        self.raised_at[local_rank] = now
                        self.hangs.error_seen(local_rank, self.error_file(local_rank), self.live(),
                                              list(self.raised_at))  # a collective timeout: stacks now
                    continue
                if now - self.raised_at[local_rank] < RAISED_GRACE_S:
                    continue
            del running[local_rank]
            if code == 0:
                self.finished.append(self.layout.global_rank(local_rank))
            else:
                failures.append(Failure.from_exit(self.layout.node_rank, self.layout.global_rank(local_rank),
                                                  local_rank, code, self.error_file(local_rank), POLL_S))

    def collect_more(self, running: Dict[int, Worker], failures: List[Failure],
                     remote_failed: Callable[[], bool]) -> None:
        """Give ranks that failed at nearly the same time a moment (0.1 s) to be seen too. While every failure seen
        only reports a lost peer and no other node published one, wait until every rank here has ended (up to
        SECONDARY_WAIT_S): a rank's own exit (a code, a signal, its error file) then outranks the peers' connection
        errors in the summary, however slowly that rank exits."""
        start = time.monotonic()
        while running:
            time.sleep(POLL_S)
            self.poll(running, failures)
            waited = time.monotonic() - start
            if waited >= 0.1 and (waited >= SECONDARY_WAIT_S or not all(f.secondary for f in failures)
                                  or remote_failed()):
                return

    def stop_all(self, grace_s: float, stop_marker: Optional[str], reaper: Any) -> List[int]:
        """SIGTERM every rank's process group, SIGKILL what is left after ``grace_s`` (the ranks' own children
        included), reap the ranks; the global ranks that had to be SIGKILLed. ``stop_marker``: a file created first
        (ranks that record SIGTERM: this one means "end now"). Idempotent."""
        workers = {r: w for r, w in self.workers.items() if w.pid not in self._stopped}
        alive = {r: w for r, w in workers.items() if w.poll() is None}
        if alive and stop_marker:
            open(stop_marker, "w").close()
        for worker in alive.values():
            kill_group(worker.pid, signal.SIGTERM)
        start, limit = time.monotonic(), {r: grace_s + (EXITING_S if r in self.raised_at else 0) for r in alive}
        while any(w.poll() is None and time.monotonic() - start < limit[r] for r, w in alive.items()):
            time.sleep(0.02)
        stubborn = [self.layout.global_rank(r) for r, w in alive.items() if w.poll() is None]
        for worker in workers.values():  # anything left, grandchildren included
            kill_group(worker.pid, signal.SIGKILL)
        for worker in workers.values():
            reap(worker)
            self._stopped.add(worker.pid)
            if reaper is not None:
                reaper.forget(worker.pid)
        return stubborn
