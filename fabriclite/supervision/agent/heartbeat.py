"""One node's heartbeat in a multi-node round, as its supervisor's loop drives it (the protocol is
distributed/control_plane/liveness.py): every PULSE_S a pulse runs on the store's own thread (distributed/
store_client.py), so the loop never waits for the network; node 0 also reads every node's pulse. Under
``--fault-tolerant`` each node is a job of its own and the lighthouse is what it shares with the others:
:class:`LighthouseHeartbeat` ends a replica group that cannot reach it (the other groups go on without it).

:meth:`NodeHeartbeat.tick` says what the loop must act on:

- :class:`Ending` (the round ends here, with its summary): the job failed elsewhere, or node 0 found nodes that
  stopped answering (it published them); or this node's pulse got no answer for the heartbeat timeout: it cannot
  reach the job's store (a partition, or node 0's host is down) and ends itself; or, under ``--slow-link stop``, this
  node's own link is slow (the supervisor publishes that as the job's failure);
- :class:`Notice`: a gray link: this node's pulses take seconds (a healthy link answers in milliseconds), with its
  ranks' step rate then and before; node 0 relays what the other nodes report. Once per node and round.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from fabriclite.distributed.control_plane import failure_flag, keys, liveness
from fabriclite.distributed.network import local_address_towards
from fabriclite.distributed.store_client import Request, StoreClient, clock

#: a gray link: the median round trip of this node's last SLOW_PULSES pulses is at least SLOW_RTT_S and SLOW_RISE
#: times the median of its pulses before them, and (when its ranks report steps) their step rate over the last
#: RATE_WINDOW_S is at most 1 / SLOW_DROP of the best earlier one (while that is not known yet, it waits). Measured on the namespace hosts: a link shaped to
#: 50 kbit/s answers in 0.05-0.6 s (median ~0.35 s) and the steps fall from ~35/s to under 1/s; a healthy one
#: answers in 0-6 ms
SLOW_RTT_S = 0.1
SLOW_PULSES = 4
SLOW_RISE = 20.0
SLOW_DROP = 5.0
RATE_WINDOW_S = 5.0
SLOW_LINK_ENV = "FABRICLITE_SLOW_LINK"
SLOW_LINK_POLICIES = ("report", "stop")


def slow_link_policy(value: Optional[str] = None) -> str:
    """``value`` > $FABRICLITE_SLOW_LINK > "report"; ValueError naming a value that is not a policy."""
    policy = value if value is not None else os.environ.get(SLOW_LINK_ENV, "report")
    if policy not in SLOW_LINK_POLICIES:
        raise ValueError(f"slow-link policy {policy!r} ({SLOW_LINK_ENV} / --slow-link): expected one of "
                         f"{', '.join(SLOW_LINK_POLICIES)} (report: say so and go on; stop: end the job).")
    return policy


@dataclass
class Ending:
    """The round ends on this node: ``summary`` (its first line the cause), ``cause`` and ``rank`` for the events
    record, ``hang`` (another node's hang, "node 1 reported a hang": take this node's stacks too), ``lost`` (a node is gone: no restart),
    ``publish`` (a message this node publishes as the job's failure, or "")."""

    summary: str
    cause: str
    rank: Optional[int] = None
    hang: str = ""
    lost: bool = False
    publish: str = ""


@dataclass
class Notice:
    """A slow link: ``line`` for stderr, ``record`` for the events record."""

    line: str
    record: Dict[str, Any]


Outcome = Union[Ending, Notice]


class NodeHeartbeat:
    """Node ``node_rank``'s heartbeat (see the module docstring). ``steps()``: the fewest optimizer steps of this
    node's ranks in the round (None before they report), for the rates of a slow-link report."""

    def __init__(self, num_nodes: int, node_rank: int, ranks_per_node: int, main_address: str, loss_s: float,
                 steps: Callable[[], Optional[int]]) -> None:
        self.num_nodes, self.node, self.ranks_per_node = num_nodes, node_rank, ranks_per_node
        self.main_address, self.loss_s, self.steps = main_address, loss_s, steps
        self.policy = slow_link_policy()
        self.store: Any = None
        self._beat: Optional[Request] = None
        self._next = 0.0
        self._watch: Optional[liveness.Heartbeats] = None
        self._rtts: List[float] = []
        self._rates: List[Tuple[float, int]] = []  # (monotonic, steps) at each answered pulse
        self._reported = False
        self._relayed: List[Dict[str, Any]] = []

    def start_round(self, store: StoreClient) -> None:
        """A round: say where this node runs; node 0 starts watching every other node's pulse."""
        self.store, self._beat, self._next = store, None, 0.0
        self._rtts, self._rates, self._reported, self._relayed = [], [], False, []
        self._watch = (liveness.Heartbeats(self.num_nodes, self.ranks_per_node, self.loss_s)
                       if self.node == 0 else None)
        host, address = socket.gethostname(), local_address_towards(self.main_address)
        try:
            liveness.announce(store, self.node, f"{host}, {address}" if address and address != host else host)
        except RuntimeError:
            pass  # the store is already unreachable: the pulses say so

    def tick(self) -> Optional[Outcome]:
        """Call from the loop (it returns at once): what to act on, or None."""
        beat = self._beat
        if beat is not None and not beat.done.is_set():
            sent = beat.started or beat.submitted
            return self._lost(sent) if time.time() - sent > self.loss_s else None
        outcome: Optional[Outcome] = None
        if beat is not None:
            self._beat = None
            outcome = self._answered(beat)
        if outcome is None and self._relayed:
            record = self._relayed.pop(0)
            outcome = Notice(_slow_line(record), record)
        self._send_if_due()
        return outcome

    def keep_alive(self) -> None:
        """Pulse on while the loop waits elsewhere (for a failure's root cause): node 0 must not take this node for
        lost meanwhile. What the pulses answer is left unread: the round is ending."""
        if self.store is not None and (self._beat is None or self._beat.done.is_set()):
            self._send_if_due()

    def _send_if_due(self) -> None:
        """The next pulse, on the store's thread, once PULSE_S has passed since the last one was sent."""
        if time.monotonic() >= self._next:
            self._next = time.monotonic() + liveness.PULSE_S
            self._beat = self.store.submit(self._pulse)

    def _answered(self, beat: Request) -> Optional[Outcome]:
        try:
            remote = beat.outcome()
        except RuntimeError as err:  # the store answered with an error: its host is gone
            remote = failure_flag.store_gone(err)
        if remote is not None:
            return self._failed(remote)
        assert beat.started is not None and beat.finished is not None
        self._rtts.append(beat.finished - beat.started)
        steps = self.steps()
        if steps is not None:
            self._rates.append((time.monotonic(), steps))
        if self._reported or not self._slow():
            return None
        self._reported = True
        record = self._slow_record(self._rtts[-SLOW_PULSES:])
        line = _slow_line(record)
        if self.policy == "stop":
            cause = line.removeprefix("fabriclite: ")
            return Ending(f"fabriclite: the job failed: {cause}\n  stopping the ranks of node {self.node}.", cause,
                          publish=cause)
        self.store.submit(_report_slow, self.node, record)  # node 0 relays it: no wait here
        return Notice(line, record)

    def _failed(self, remote: Dict[str, Any]) -> Ending:
        """The job failed on another node, or node 0 found nodes that stopped answering."""
        summary = f"fabriclite: {failure_flag.failure_line(remote)}\n  stopping the ranks of node {self.node}."
        hang = f"node {remote.get('node')} reported a hang" if remote.get("hang") else ""
        return Ending(summary, str(remote.get("message", "")), remote.get("rank"), hang, bool(remote.get("lost")))

    def _lost(self, since: float) -> Ending:
        """This node's pulse got no answer for the heartbeat timeout: it cannot reach the job."""
        port = self.store.where.rsplit(":", 1)[-1]
        why = (f"the job's store on node 0 ({self.main_address}:{port}) is unreachable since {clock(since)} (no answer "
               f"for {time.time() - since:.0f} s, --heartbeat-timeout {self.loss_s:g})")
        cause = f"node {self.node} lost the job's store: {why}"
        return Ending(f"fabriclite: {cause}.\n  stopping the ranks of node {self.node}.", cause, lost=True)

    def _pulse(self, store: Any) -> Optional[Dict[str, Any]]:
        """On the store's thread: this node's pulse; node 0 also reads every node's, publishes the nodes that stopped
        answering as the job's failure, and picks up the slow links other nodes reported."""
        remote = liveness.pulse(store, self.node)
        if remote is None and self._watch is not None:
            remote = self._watch.poll(store)
            if remote is not None:
                failure_flag.publish_failure(store, remote, self.num_nodes)
            for node in self._watch.newly_slow:
                self._relayed.append(json.loads(store.get(keys.slow_link(node))))
            self._watch.newly_slow.clear()
        return remote

    def _slow(self) -> bool:
        """Whether this node's link is gray (see SLOW_RTT_S)."""
        recent, before = self._rtts[-SLOW_PULSES:], self._rtts[:-SLOW_PULSES]
        if len(before) < SLOW_PULSES:
            return False
        median = statistics.median(recent)
        if median < max(SLOW_RTT_S, SLOW_RISE * statistics.median(before)):
            return False
        if not self._rates:  # the ranks report no steps (no optimizer of fabric's): the round trips alone
            return True
        best, now = _rates(self._rates)
        return best is not None and now is not None and now * SLOW_DROP <= best  # else: not known yet, wait

    def _slow_record(self, rtts: List[float]) -> Dict[str, Any]:
        before, now = _rates(self._rates)
        host = socket.gethostname()
        return {"node": self.node, "host": host, "rtt_median_s": round(statistics.median(rtts), 3),
                "rtt_max_s": round(max(rtts), 3), "steps_per_s": now, "steps_per_s_before": before,
                "at": clock(time.time())}


def _report_slow(store: Any, node: int, record: Dict[str, Any]) -> None:
    liveness.report_slow(store, node, json.dumps(record))


def _rates(samples: List[Tuple[float, int]]) -> Tuple[Optional[float], Optional[float]]:
    """(the best steps/s over RATE_WINDOW_S before the last RATE_WINDOW_S, the steps/s over the last RATE_WINDOW_S)
    from ``samples`` ((monotonic, steps) at each pulse); None where the samples do not span one."""
    if len(samples) < 2:
        return None, None
    end_t, end_n = samples[-1]
    start = next(s for s in samples if s[0] >= end_t - RATE_WINDOW_S)
    now = (end_n - start[1]) / (end_t - start[0]) if end_t - start[0] >= RATE_WINDOW_S / 2 else None
    best = None
    for i, (t0, n0) in enumerate(samples):
        t1, n1 = next(((t, n) for t, n in samples[i + 1:] if t - t0 >= RATE_WINDOW_S), (None, None))
        if t1 is None or t1 > start[0]:
            break
        rate = (n1 - n0) / (t1 - t0)
        best = rate if best is None or rate > best else best
    return (None if best is None else round(best, 2)), (None if now is None else round(now, 3))


def _slow_line(record: Dict[str, Any]) -> str:
    rates = ""
    if record.get("steps_per_s") is not None:
        before = record.get("steps_per_s_before")
        rates = f"; its ranks step at {record['steps_per_s']:g} steps/s" + (
            f", from {before:g} steps/s" if before is not None else "")
    return (f"fabriclite: node {record['node']} ({record['host']}) has a slow link to the job's store on node 0: "
            f"its heartbeats take {record['rtt_median_s']:g} s (median of the last {SLOW_PULSES}, up to "
            f"{record['rtt_max_s']:g} s; a healthy link answers in milliseconds){rates}.")


class LighthouseHeartbeat:
    """A replica group's link to the lighthouse (``--fault-tolerant``, a node that does not host it): a thread of its
    own connects to ``host:port`` every PULSE_S (at most CONNECT_S each); :meth:`tick` returns an :class:`Ending` once
    no connection succeeded for ``loss_s``: the group is cut off, the others drop it from their quorum, and it ends
    itself instead of waiting on torchft's timeouts (a group started again once the link is back heals from a live
    one)."""

    CONNECT_S = 1.0

    def __init__(self, node_rank: int, host: str, port: int, loss_s: float) -> None:
        self.node, self.host, self.port, self.loss_s = node_rank, host, port, loss_s
        self._answered = time.time()
        self._stop = threading.Event()
        threading.Thread(target=self._probe, name="fabriclite-lighthouse-heartbeat", daemon=True).start()

    def _probe(self) -> None:
        while not self._stop.wait(liveness.PULSE_S):
            try:
                socket.create_connection((self.host, self.port), timeout=self.CONNECT_S).close()
                self._answered = time.time()
            except OSError:
                pass

    def tick(self) -> Optional[Ending]:
        since = self._answered
        if time.time() - since <= self.loss_s:
            return None
        cause = (f"node {self.node} lost the lighthouse: the lighthouse at {self.host}:{self.port} is unreachable since "
                 f"{clock(since)} (no answer for {time.time() - since:.0f} s, --heartbeat-timeout {self.loss_s:g}); "
                 f"the other replica groups go on without this one")
        return Ending(f"fabriclite: {cause}.\n  stopping the ranks of replica group {self.node}.", cause, lost=True)

    def close(self) -> None:
        self._stop.set()
