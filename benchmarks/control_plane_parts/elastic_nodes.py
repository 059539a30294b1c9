"""The anchor: torchrun's agents, as many as the model's nodes, each with torchelastic's own
``DynamicRendezvousHandler`` on a ``C10dRendezvousBackend`` over its own connection to the store (a libuv
TCPStore, as torchrun's ``c10d`` rendezvous hosts it). Their state machines, state holder and backend are
torchelastic's, unchanged; only the loop that turns them is the model's: torchelastic's executor sleeps 1 s where
its join op says SYNC, and this loop schedules the next step 1 s later instead (the same requests, at the same
times, without a thread per agent).

After a rendezvous each agent does what torchrun's does while its workers run: a keep-alive every 5 s
(``keep_alive_interval``) and, every 0.1 s (``--monitor-interval``), ``num_nodes_waiting()`` (served from the
state holder's 1 s cache between reads). A worker failure: that agent re-enters the rendezvous (exit op, then
join op); every other agent restarts its workers when it sees a node waiting, and joins too. torchelastic has no
preemption agreement between agents (a preempted agent just ends), so that row is "n/a" for it."""
from __future__ import annotations

import random
import time
from datetime import timedelta
from typing import Any, Callable, Dict, Optional

from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
    _Action,
    _RendezvousContext,
    _RendezvousExitOp,
    _RendezvousJoinOp,
)

from control_plane_parts.loop import Done, Loop
from control_plane_parts.store_host import Connection

RUN_ID = "control-plane-model"
MONITOR_INTERVAL_S = 0.1  # torchrun's --monitor-interval default
KEEP_ALIVE_S = 5  # torchelastic's keep_alive_interval default
_SYNC_DELAY_S = 1.0  # what torchelastic's executor sleeps on SYNC

#: _Action -> the executor's method, as in _DistributedRendezvousOpExecutor.run
_APPLY = {
    _Action.KEEP_ALIVE: "_keep_alive", _Action.ADD_TO_PARTICIPANTS: "_add_to_participants",
    _Action.ADD_TO_WAIT_LIST: "_add_to_wait_list", _Action.ADD_TO_REDUNDANCY_LIST: "_add_to_redundancy_list",
    _Action.REMOVE_FROM_PARTICIPANTS: "_remove_from_participants",
    _Action.REMOVE_FROM_WAIT_LIST: "_remove_from_wait_list",
    _Action.REMOVE_FROM_REDUNDANCY_LIST: "_remove_from_redundancy_list",
    _Action.MARK_RENDEZVOUS_COMPLETE: "_mark_rendezvous_complete",
    _Action.MARK_RENDEZVOUS_CLOSED: "_mark_rendezvous_closed",
}


class Agent:
    """One torchrun agent's rendezvous side."""

    def __init__(self, node: int, port: int, num_nodes: int, cap_s: float) -> None:
        self.node = node
        self.conn = Connection(port)
        backend = C10dRendezvousBackend(self.conn.store, RUN_ID)
        self.handler = DynamicRendezvousHandler.from_backend(
            RUN_ID, self.conn.store, backend, num_nodes, num_nodes, local_addr=f"sim-node-{node}",
            timeout=RendezvousTimeout(join=timedelta(seconds=cap_s)), keep_alive_interval=KEEP_ALIVE_S)
        self.running = False  # its workers run (after a rendezvous, until it restarts them)
        self.on_stop: Optional[Callable[[], None]] = None

    def _step(self, op: Any, deadline: float) -> Optional[float]:
        """Turn the executor's loop until it would sleep (the delay) or finish (None)."""
        ex = self.handler._op_executor
        while True:
            ex._state_holder.sync()
            ex._state = ex._state_holder.state
            action = op(_RendezvousContext(ex._node, ex._state, ex._settings), deadline)
            if action == _Action.FINISH:
                return None
            if action in (_Action.ERROR_CLOSED, _Action.ERROR_TIMEOUT):
                raise RuntimeError(f"node {self.node}: rendezvous {action.name}")
            if action == _Action.SYNC:
                return _SYNC_DELAY_S
            getattr(ex, _APPLY[action])()
            ex._state_holder.mark_dirty()

    def join(self, loop: Loop, done: Done) -> None:
        """next_rendezvous(): the first round's random 0-0.3 s delay, the exit op, the join op; then heartbeats
        and the monitor loop. ``done`` gets this node's time when it has joined."""
        handler = self.handler
        deadline = handler._get_deadline(handler._settings.timeout.join)
        stage = ["start"]

        def task() -> Optional[float]:
            with self.conn:
                if stage[0] == "start":
                    stage[0] = "exit"
                    if handler._state_holder.state.round == 0:
                        return random.uniform(0, 0.3)
                if stage[0] == "exit":
                    self._step(_RendezvousExitOp(), deadline)
                    stage[0] = "join"
                delay = self._step(_RendezvousJoinOp(), deadline)
            if delay is not None:
                return delay
            done.mark(self.node)
            self.running = True
            loop.soon(self._keep_alive_task(), KEEP_ALIVE_S)
            loop.soon(self._monitor_task(), MONITOR_INTERVAL_S)
            return None

        loop.soon(task)

    def _keep_alive_task(self) -> Callable[[], Optional[float]]:
        def task() -> Optional[float]:
            if not self.running:
                return None
            with self.conn:
                self.handler._keep_alive()
            return KEEP_ALIVE_S
        return task

    def _monitor_task(self) -> Callable[[], Optional[float]]:
        def task() -> Optional[float]:
            if not self.running:
                return None
            with self.conn:
                waiting = self.handler.num_nodes_waiting()
            if waiting > 0 and self.on_stop is not None:
                self.running = False
                self.on_stop()
                return None
            return MONITOR_INTERVAL_S
        return task


class ElasticNodes:
    """The agents of one worker process; the phases the controller runs."""

    def __init__(self, spec: Dict[str, Any], loop: Loop) -> None:
        self.loop = loop
        self.agents = {n: Agent(n, spec["port"], spec["num_nodes"], spec["cap_s"]) for n in spec["nodes"]}

    def rendezvous(self, start: float, deadline: float) -> Dict[str, Any]:
        done = Done()
        for agent in self.agents.values():
            self.loop.at(start, lambda a=agent: a.join(self.loop, done))
        finished = done.wait(len(self.agents), deadline)
        return {"times": done.times, "finished": finished}

    def steady(self, start: float, until: float, rate: float) -> Dict[str, Any]:
        """Steady state: the agents' keep-alives and monitors run until ``until`` (torchrun's workers say nothing
        to the store per step, whatever the step rate)."""
        time.sleep(max(0.0, until - time.monotonic()))
        return {}

    def memory(self, start: float, steps: int, rate: float) -> Dict[str, Any]:
        """As long as ``steps`` steps at ``rate`` take: the same traffic as in steady state."""
        return self.steady(start, start + steps / rate, rate)

    def failure(self, start: float, node: int, deadline: float) -> Dict[str, Any]:
        """A worker of ``node`` fails at ``start``: every agent's time of stopping its workers (``stopped``) and
        of having joined the next round (``times``)."""
        stopped, joined = Done(), Done()
        for agent in self.agents.values():
            def restart(a: Agent = agent) -> None:
                stopped.mark(a.node)
                a.join(self.loop, joined)
            agent.on_stop = restart
        if node in self.agents:
            failing = self.agents[node]
            restart_failing = failing.on_stop

            def fail() -> None:
                failing.running = False  # its monitor sees the worker gone (within one interval)
                restart_failing()  # type: ignore[misc]
            self.loop.at(start + random.uniform(0, MONITOR_INTERVAL_S), fail)
        stopped_all = stopped.wait(len(self.agents), deadline)
        finished = stopped_all and joined.wait(len(self.agents), deadline)
        return {"stopped": stopped.times, "times": joined.times, "finished": finished, "stopped_all": stopped_all}
