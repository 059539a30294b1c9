"""fabriclite's side: each simulated node runs the supervisor's half of the store protocol and its ranks run
theirs, through the same modules a real job uses (fabriclite/distributed/control_plane), one step at a time:
every waiting loop there is a poller (``poll()`` makes O(1) requests, ``delay()`` says when to poll next) that a
real supervisor or rank turns with ``time.sleep`` and this model turns from its event loop.

- Supervisor (one connection per node): its pulse every ``liveness.PULSE_S`` (the heartbeat whose answer carries
  the failure flag; node 0 also reads every node's pulse, ``liveness.Heartbeats``), its straggler report once per window (node 0 also collects them), the restart agreement after
  a failure, the preemption agreement.
- Ranks (``ranks_per_node`` per node, on ``rank_conns`` connections per node): the check-in at launch
  (``meeting.Arrival``), a ``rank_zero_first`` block every ``zero_first_every`` steps (global rank 0 runs it and
  announces, every other rank waits for the word), and the collective-progress record every
  ``collective_progress.publish_interval`` of the default 30-minute timeout.
"""
from __future__ import annotations

import random
import time
from typing import Any, Callable, Dict, List, Optional

from fabriclite.distributed.control_plane import (collective_progress, failure_flag, keys, liveness, meeting,
                                                  rank_zero_first, restart_agreement, straggler_reports)

from control_plane_parts.loop import Done, Loop
from control_plane_parts.store_host import Connection

#: the collective timeout the model's ranks run with (fabriclite's default)
TIMEOUT_S = 1800.0
#: nodes whose connections a worker process opens at once
CONNECTING = 8


def _poll_chain(poller: Any, on_done: Callable[[Any], None], first: Optional[Callable[[], None]] = None) \
        -> Callable[[], Optional[float]]:
    """A chain that turns ``poller`` (``first`` once before) until ``poll()`` gives a result."""
    started = [first is None]

    def task() -> Optional[float]:
        if not started[0]:
            started[0] = True
            first()  # type: ignore[misc]
        result = poller.poll()
        if result is None or result is False:
            return poller.delay()
        on_done(result)
        return None
    return task


class Node:
    """One simulated node: its supervisor's connection and its ranks' connections."""

    def __init__(self, node: int, spec: Dict[str, Any]) -> None:
        self.node, self.nodes = node, spec["num_nodes"]
        self.per_node = spec["ranks_per_node"]
        self.world = self.nodes * self.per_node
        self.sup = Connection(spec["port"])
        self.rank_conns = [Connection(spec["port"]) for _ in range(spec["rank_conns"])]
        self.round = 0
        self.views: Dict[Any, Any] = {}
        self.running = False  # the supervisor's pulse chain runs
        self.on_failure: Optional[Callable[[Dict[str, Any]], None]] = None
        self.steps = 0
        self.reports = straggler_reports.Collector(self.nodes) if node == 0 else None
        self.heartbeats: Optional[liveness.Heartbeats] = None

    def ranks(self) -> List[int]:
        return [self.node * self.per_node + i for i in range(self.per_node)]

    def conn_of(self, rank: int) -> Connection:
        return self.rank_conns[rank % len(self.rank_conns)]

    def view(self, conn: Connection) -> Any:
        key = (id(conn), self.round)
        if key not in self.views:
            self.views[key] = meeting.job_view(conn.store, self.round)
        return self.views[key]

    # ------------------------------------------------------------------ the supervisor
    def pulse_chain(self) -> Callable[[], Optional[float]]:
        """The supervisor's pulses in one round (node 0 also watches every node's: a new watch each round)."""
        if self.node == 0:
            self.heartbeats = liveness.Heartbeats(self.nodes, self.per_node, liveness.DEFAULT_LOSS_S)

        def task() -> Optional[float]:
            if not self.running:
                return None
            with self.sup:
                record = liveness.pulse(self.view(self.sup), self.node)
                if record is None and self.heartbeats is not None:
                    record = self.heartbeats.poll(self.view(self.sup))
            if record is not None and self.on_failure is not None:
                self.running = False
                self.on_failure(record)
                return None
            return liveness.PULSE_S
        return task

    def straggler_window(self, window: int) -> None:
        """The supervisor's work at the end of straggler window ``window``: its report; node 0 also collects."""
        busy = {rank: 0.1 + 0.01 * random.random() for rank in self.ranks()}
        with self.sup:
            view = self.view(self.sup)
            straggler_reports.publish(view, window, self.node, busy)
            if self.reports is not None:
                self.reports.collect(view, window)

    # ------------------------------------------------------------------ the ranks
    def arrival_chain(self, rank: int, done: Callable[[], None]) -> Callable[[], Optional[float]]:
        conn = self.conn_of(rank)
        arrival = meeting.Arrival(self.view(conn), keys.ARRIVED, rank, self.world)

        def task() -> Optional[float]:
            with conn:
                if not arrival.arrived:
                    arrival.arrive()
                if arrival.poll():
                    arrival.leave()
                    done()
                    return None
            return arrival.delay()
        return task

    def progress_chain(self, rank: int, until: float) -> Callable[[], Optional[float]]:
        conn = self.conn_of(rank)
        interval = collective_progress.publish_interval(TIMEOUT_S)

        def task() -> Optional[float]:
            if time.monotonic() >= until:
                return None
            record = {"counts": {"0": [self.steps * 3, "all_reduce"]}, "time": time.time(), "left": False}
            with conn:
                collective_progress.publish(self.view(conn), rank, record)
            return interval
        return task

    def zero_first_chain(self, rank: int, call: int, done: Callable[[], None]) -> Callable[[], Optional[float]]:
        conn = self.conn_of(rank)
        key = keys.rank_zero_first(call)
        if rank == 0:
            def announce() -> Optional[float]:
                with conn:
                    rank_zero_first.announce(self.view(conn), key, "ok", self.world - 1)
                done()
                return None
            return announce
        waiter = rank_zero_first.Waiter(self.view(conn), key, self.world - 1)

        def task() -> Optional[float]:
            with conn:
                outcome = waiter.poll()
            if outcome is None:
                return waiter.delay()
            done()
            return None
        return task

    # ------------------------------------------------------------------ agreements
    def agreement_chain(self, able: bool, done: Callable[[Optional[float]], None]) -> Callable[[], Optional[float]]:
        agreement = restart_agreement.Agreement(self.sup.store, self.round, self.node, self.nodes, able,
                                                allowed=lambda: 0.0)

        def task() -> Optional[float]:
            with self.sup:
                if not agreement.reported:
                    agreement.report()
                finished = agreement.poll()
            if not finished:
                return agreement.delay()
            done(agreement.decision)
            return None
        return task


class FabricNodes:
    """The nodes of one worker process; the phases the controller runs."""

    def __init__(self, spec: Dict[str, Any], loop: Loop) -> None:
        import os

        os.environ["FABRICLITE_STRAGGLER_WINDOW"] = str(spec["window"])
        self.loop, self.spec = loop, spec
        self.window, self.zero_first_every = spec["window"], spec["zero_first_every"]
        # connections opened a few at a time: a connection's handshake through two relays is a few round trips
        # between processes, which one after another on a loaded machine take minutes at 4,096 nodes (both
        # fabriclite sides open theirs the same way; node 0's relay caps unproven connections at 64, this keeps
        # the workers' together under that)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(CONNECTING) as pool:
            self.nodes = dict(zip(spec["nodes"], pool.map(lambda n: Node(n, spec), spec["nodes"])))
        self.requests: Dict[str, int] = {}

    def rendezvous(self, start: float, deadline: float) -> Dict[str, Any]:
        done = Done()
        for node in self.nodes.values():
            left = [node.per_node]

            def one(node: Node = node, left: List[int] = left) -> None:
                left[0] -= 1
                if left[0] == 0:
                    done.mark(node.node)
                    node.running = True
                    self.loop.soon(node.pulse_chain(), random.uniform(0, liveness.PULSE_S))
            for rank in node.ranks():
                self.loop.at(start, node.arrival_chain(rank, one))
        finished = done.wait(len(self.nodes), deadline)
        return {"times": done.times, "finished": finished}

    def _steps(self, start: float, until: float, rate: float) -> Dict[str, Any]:
        """Steps at ``rate`` from ``start`` to ``until``: the straggler windows and rank_zero_first blocks fall due
        by step count, the progress records by time."""
        first_step = next(iter(self.nodes.values())).steps
        behind = [0]
        for node in self.nodes.values():
            for rank in node.ranks():
                # each rank's record is there from the phase's start (a real rank's first comes one interval after
                # it joined; the model does not wait that long, so the key count is flat from the start)
                self.loop.at(start + random.uniform(0, 1.0), node.progress_chain(rank, until))

            def stepper(node: Node = node) -> Optional[float]:
                now = time.monotonic()
                target = first_step + int((min(now, until) - start) * rate)
                while node.steps < target:
                    node.steps += 1
                    if node.steps % self.window == 0:
                        node.straggler_window(node.steps // self.window)
                    if node.steps % self.zero_first_every == 0:
                        call = node.steps // self.zero_first_every
                        for rank in node.ranks():
                            self.loop.soon(node.zero_first_chain(rank, call, lambda: None))
                behind[0] = max(behind[0], first_step + int((time.monotonic() - start) * rate) - node.steps)
                if now >= until:
                    return None
                return max(0.001, (node.steps + 1 - first_step) / rate + start - time.monotonic())
            self.loop.at(start, stepper)
        time.sleep(max(0.0, until - time.monotonic()) + 0.2)
        return {"behind_steps": behind[0]}

    def steady(self, start: float, until: float, rate: float) -> Dict[str, Any]:
        return self._steps(start, until, rate)

    def memory(self, start: float, steps: int, rate: float) -> Dict[str, Any]:
        return self._steps(start, start + steps / rate, rate)

    def _agree_after(self, start: float, node: int, deadline: float, preempted: bool) -> Dict[str, Any]:
        stopped, decided = Done(), Done()
        decisions: List[Optional[float]] = []

        def agree(n: Node, able: bool) -> None:
            def done(decision: Optional[float]) -> None:
                decisions.append(decision)
                n.round += 1
                decided.mark(n.node)
                if decision is not None or preempted:  # the next round (after a preemption: the memory phase's)
                    n.running = True
                    self.loop.soon(n.pulse_chain(), random.uniform(0, liveness.PULSE_S))
            self.loop.soon(n.agreement_chain(able, done))

        for n in self.nodes.values():
            def seen(record: Dict[str, Any], n: Node = n) -> None:
                stopped.mark(n.node)
                agree(n, True)
            n.on_failure = seen
        if node in self.nodes:
            failing = self.nodes[node]

            def fail() -> None:
                failing.running = False
                what = "was preempted and stopped its ranks" if preempted else "saw rank fail"
                with failing.sup:
                    failure_flag.publish_failure(failing.view(failing.sup), {
                        "node": node, "rank": None, "timestamp": time.time(), "secondary": False,
                        "message": f"the supervisor of node {node} {what}"}, failing.nodes)
                stopped.mark(node)
                agree(failing, not preempted)
            self.loop.at(start, fail)
        stopped_all = stopped.wait(len(self.nodes), deadline)
        finished = stopped_all and decided.wait(len(self.nodes), deadline)
        return {"stopped": stopped.times, "times": decided.times, "finished": finished, "stopped_all": stopped_all,
                "decisions": sorted({str(d) for d in decisions})}

    def failure(self, start: float, node: int, deadline: float) -> Dict[str, Any]:
        return self._agree_after(start, node, deadline, preempted=False)

    def preempt(self, start: float, node: int, deadline: float) -> Dict[str, Any]:
        return self._agree_after(start, node, deadline, preempted=True)
