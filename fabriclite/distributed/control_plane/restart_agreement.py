"""The restart agreement: after a failed round every node's supervisor reports whether it can go on; node 0's
decides for the job and publishes the delay before the next round (or None: stop). Takes the job's store itself
(the keys ``restarts/<round>/...`` are outside ``keys.PREFIX`` and outside any round's part).

Each report is one ``add`` to one counter (+1, and +UNABLE from a node that cannot go on), so node 0 reads every
node's word in one request per poll, and every other node polls for the decision, with a backoff: no poll is O(N).
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable, Optional

from fabriclite.distributed.control_plane import keys, polling

#: how long node 0 waits for every node's report after a failed round, and the others for its decision
AGREE_S = 60.0
_POLL_FIRST_S, _POLL_MOST_S = 0.01, 0.25


class Agreement:
    """One node's side of the agreement after failed round ``round_number``: :meth:`report`, then :meth:`poll` until
    it returns True (``delay()`` seconds apart); the outcome is :attr:`decision`. ``allowed()`` (node 0 only): the
    delay the restart policy allows, or None."""

    def __init__(self, store: Any, round_number: int, node_rank: int, num_nodes: int, able: bool,
                 allowed: Callable[[], Optional[float]]) -> None:
        self.store, self.round, self.node, self.nodes = store, round_number, node_rank, num_nodes
        self.able, self.allowed = able, allowed
        self.reported = False
        self.decision: Optional[float] = None
        self._deadline = time.monotonic() + AGREE_S + (0 if node_rank == 0 else 5)
        self._backoff = polling.Backoff(_POLL_FIRST_S, polling.ceiling(num_nodes, _POLL_MOST_S))

    def report(self) -> None:
        self.store.add(keys.restart_reports(self.round), 1 if self.able else 1 + keys.UNABLE)
        self.reported = True

    def poll(self) -> bool:
        """Whether the decision is there (node 0: made, once every node reported or AGREE_S passed)."""
        if self.node == 0:
            count = self.store.add(keys.restart_reports(self.round), 0)
            timed_out = time.monotonic() > self._deadline
            if self.able and count % keys.UNABLE < self.nodes and not timed_out:
                return False  # node 0 itself unable (a signal, a lost node): no report can change the outcome
            able = self.able and not timed_out and count < keys.UNABLE
            self.decision = self.allowed() if able else None
            self.store.set(keys.restart_decision(self.round), json.dumps({"delay": self.decision}))
            if self.round > 0:  # every node read the last round's decision before this round started
                for key in (keys.restart_reports(self.round - 1), keys.restart_decision(self.round - 1)):
                    self.store.delete_key(key)
            return True
        key = keys.restart_decision(self.round)
        if not self.store.check([key]):
            if time.monotonic() > self._deadline:
                self.decision = None
                return True
            return False
        self.decision = json.loads(self.store.get(key))["delay"]
        return True

    def delay(self) -> float:
        return self._backoff.next()


def agree(store: Any, round_number: int, node_rank: int, num_nodes: int, able: bool,
          allowed: Callable[[], Optional[float]]) -> Optional[float]:
    """The delay before the round after ``round_number``, the same on every node, or None to stop. ``able``: whether
    this node can go on; ``allowed()`` (node 0 only): the delay the restart policy allows, or None. A node that
    does not report within AGREE_S ends the job; a store that is gone (RuntimeError) means no restart."""
    agreement = Agreement(store, round_number, node_rank, num_nodes, able, allowed)
    try:
        agreement.report()
        polling.wait_until(agreement.poll, agreement.delay)
        return agreement.decision
    except RuntimeError:  # node 0's store is gone: the job cannot restart
        return None
