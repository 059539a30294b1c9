"""Liveness across nodes: each supervisor's pulse, node 0 watching every node's, and node 0 keeping the store up
until the other nodes have ended. Every function takes the job's store seen under ``keys.PREFIX`` (the round's part:
``meeting.job_view``).

One counter per node, ``pulse/<node>``: its supervisor adds 1 every PULSE_S, and the answer says whether the failure
flag is up (``failure_flag.publish_failure`` adds ``keys.FAILED`` to every node's). So a supervisor's steady-state
traffic is one request per PULSE_S, and a failure is seen within PULSE_S everywhere. Node 0 reads every node's count
in one ``check`` and one ``multi_get`` per PULSE_S (:class:`Heartbeats`): a node whose count has not moved for the
heartbeat timeout stopped answering (its link is down, or its host), and node 0 publishes that as the job's failure,
naming the node, its host and its ranks. A node whose own pulses get no answer for as long (its supervisor waits on
a deadline, distributed/store_client.py) has lost the job's store and ends itself.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from fabriclite.distributed.control_plane import failure_flag, keys, polling
from fabriclite.distributed.store_client import clock

#: how often each supervisor pulses (and so reads the failure flag): a failure is seen everywhere within it, and
#: with the ranks' progress records and the straggler reports a node sends at most ~1 request per second
PULSE_S = 1.5
POLL_S = 0.05
#: how long node 0 keeps the store up after a failure, for the other nodes to read it
LINGER_S = 3.0
#: after a success, node 0 stops waiting for the nodes that have not ended once no supervisor pulsed for this long
HEARTBEAT_TIMEOUT_S = 30.0
#: a node whose pulse did not move (node 0's view) or got no answer (its own view) for this long is lost: well over
#: the longest answer a short flap delays (a 3 s outage costs TCP's retransmissions up to ~6 s), well under the
#: collectives' timeout; ``--heartbeat-timeout`` / $FABRICLITE_HEARTBEAT_TIMEOUT set it
DEFAULT_LOSS_S = 15.0
LOSS_ENV = "FABRICLITE_HEARTBEAT_TIMEOUT"


def loss_timeout(collective_timeout_s: float, value: Optional[float] = None) -> float:
    """The heartbeat timeout: ``value`` > $FABRICLITE_HEARTBEAT_TIMEOUT > DEFAULT_LOSS_S, at most half the collective
    timeout (so a lost node is named before a rank's collective times out waiting for it), at least 2 pulses.
    ValueError naming a value that is not a positive number of seconds."""
    raw: Any = value if value is not None else os.environ.get(LOSS_ENV)
    if raw is None:
        return max(2 * PULSE_S, min(DEFAULT_LOSS_S, collective_timeout_s / 2))
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        seconds = -1.0
    if not seconds > 0 or seconds != seconds:
        raise ValueError(f"heartbeat timeout {raw!r} ({LOSS_ENV} / --heartbeat-timeout): expected a positive number "
                         f"of seconds, e.g. 15.")
    return max(2 * PULSE_S, seconds)


def pulse(store: Any, node: int) -> Optional[Dict[str, Any]]:
    """One pulse of node ``node``'s supervisor: None, or the job's failure once it is published (a store that answers
    with an error counts as one: its host, node 0's supervisor, is gone). One request; two once the flag is up."""
    try:
        count = store.add(keys.pulse(node), 1)
    except RuntimeError:
        return failure_flag.read_failure(store)  # says the store is gone
    return failure_flag.flagged_failure(store) if failure_flag.flagged(count) else None


def report_slow(store: Any, node: int, report: str) -> None:
    """Node ``node`` found its own link slow: its ``report`` (JSON) for node 0, then the SLOW mark on its pulse, where
    node 0's watch sees it without a request of its own (two requests, once per round)."""
    store.set(keys.slow_link(node), report)
    store.add(keys.pulse(node), keys.SLOW)


def announce(store: Any, node: int, host: str) -> None:
    """Say where node ``node`` runs (``host``: its name and address), for node 0 to name it if it goes quiet."""
    store.set(keys.node_host(node), host)


class Heartbeats:
    """Node 0's watch over the other nodes' pulses in one round: :meth:`poll` every PULSE_S (one ``check`` and one
    ``multi_get``) returns the failure record of the nodes whose pulse stopped moving ``timeout_s`` ago, or None. A
    node that has not pulsed yet in the round is not lost but late: the rendezvous timeout is for that."""

    def __init__(self, num_nodes: int, ranks_per_node: int, timeout_s: float) -> None:
        self.nodes, self.ranks_per_node, self.timeout_s = list(range(1, num_nodes)), ranks_per_node, timeout_s
        self._counts: Dict[int, bytes] = {}
        #: node -> (monotonic, wall) time its count last moved
        self._moved: Dict[int, Tuple[float, float]] = {}
        self._started: Optional[Tuple[float, float]] = None
        #: nodes whose pulse carries the SLOW mark since the last poll (their report is under keys.slow_link)
        self.newly_slow: List[int] = []
        self._slow: set = set()
        self._left: set = set()

    def poll(self, store: Any) -> Optional[Dict[str, Any]]:
        now = (time.monotonic(), time.time())
        if self._started is None:
            self._started = now
        names = [keys.pulse(node) for node in self.nodes]
        if names and store.check(names):
            present = self.nodes
        elif now[0] - self._started[0] > self.timeout_s:  # a node is late in this round: watch the others (rare)
            present = [node for node in self.nodes if store.check([keys.pulse(node)])]
        else:
            return None
        if present:
            for node, value in zip(present, store.multi_get([keys.pulse(node) for node in present])):
                if self._counts.get(node) != value:
                    self._counts[node], self._moved[node] = value, now
                marks = int(value) % keys.FAILED
                if marks >= keys.LEFT:  # it ended: its pulse stopped for good, and that is no loss
                    self._left.add(node)
                if node not in self._slow and marks % keys.LEFT >= keys.SLOW:
                    self._slow.add(node)
                    self.newly_slow.append(node)
        quiet = {node: now[0] - moved for node, (moved, _) in self._moved.items() if node not in self._left}
        if not any(s > self.timeout_s for s in quiet.values()):
            return None
        # with it, every node that went quiet at about the same time (node 0 sees each change at its next poll:
        # two nodes cut off at once differ by up to a pulse interval, and a poll's)
        together = max(self.timeout_s / 2, self.timeout_s - 2 * PULSE_S)
        return self._lost(store, sorted(n for n, s in quiet.items() if s > together))

    def silent_since(self, node: int) -> float:
        """The wall time node ``node``'s pulse last moved."""
        return self._moved[node][1]

    def _lost(self, store: Any, silent: List[int]) -> Dict[str, Any]:
        first = min(silent, key=self.silent_since)
        since = self.silent_since(first)
        hosts = {node: _host(store, node) for node in silent}

        def named(node: int) -> str:
            ranks = list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))
            return f"{node} ({hosts[node]}, ranks {ranks})"

        if len(silent) == 1:
            ranks = list(range(first * self.ranks_per_node, (first + 1) * self.ranks_per_node))
            message = f"node {first} ({hosts[first]}) stopped answering at {clock(since)}"
            message += f" (no heartbeat for {time.time() - since:.0f} s, --heartbeat-timeout {self.timeout_s:g})"
            message += f"; its ranks: {ranks}"
        else:
            every = " (every other node: is node 0's own link down?)" if len(silent) == len(self.nodes) else ""
            message = f"nodes {', '.join(named(n) for n in silent)} stopped answering{every}; the first at"
            message += f" {clock(since)} (no heartbeat for {time.time() - since:.0f} s, --heartbeat-timeout"
            message += f" {self.timeout_s:g})"
        return {"node": first, "rank": None, "message": message, "timestamp": since, "secondary": False,
                "lost": sorted(silent)}


def _host(store: Any, node: int) -> str:
    try:
        key = keys.node_host(node)
        return store.get(key).decode() if store.check([key]) else "host unknown"
    except RuntimeError:
        return "host unknown"


def _total(store: Any, num_nodes: int) -> Tuple[int, bool]:
    """(the sum of every node's pulse count, marks aside: it moves while any supervisor lives; -1 while one has not
    pulsed yet), and whether a failure is flagged on any of them."""
    names = [keys.pulse(node) for node in range(num_nodes)]
    if not store.check(names):
        return -1, failure_flag.flagged(store.add(keys.pulse(0), 0))
    values = [int(value) for value in store.multi_get(names)]
    return sum(v % keys.SLOW for v in values), any(failure_flag.flagged(v) for v in values)


def leave(store: Any, node_rank: int, num_nodes: int, failed: bool, signalled: Callable[[], bool]) -> None:
    """Across nodes, node 0 keeps the store (and so the failure record) up until every node has
    ended: after a success for as long as a supervisor that has not ended is alive (the pulse moves
    at least every HEARTBEAT_TIMEOUT_S), after a failure for at most LINGER_S. Three requests per poll; the other
    nodes mark their pulse LEFT first, so node 0's watch does not take them for lost."""
    try:
        if node_rank != 0:
            store.add(keys.pulse(node_rank), keys.LEFT)  # node 0's watch: this node ended, it is not lost
            store.add(keys.ENDED, 1)
            return
        ended = store.add(keys.ENDED, 1)
        deadline = time.monotonic() + LINGER_S if failed else None
        last, moved = _total(store, num_nodes)[0], time.monotonic()
        backoff = polling.Backoff(POLL_S, 0.5)
        while ended < num_nodes:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            count, flagged = _total(store, num_nodes)
            if deadline is None and (signalled() or flagged):
                deadline = now + LINGER_S
            if count != last:
                last, moved = count, now
            elif now - moved > HEARTBEAT_TIMEOUT_S:
                return  # the supervisors left are gone without a word: stop waiting for them
            time.sleep(backoff.next())
            ended = store.add(keys.ENDED, 0)
    except RuntimeError:
        pass
