"""The supervisor: starts one node's ranks, watches them, and turns the first failure anywhere in the job into one
clear ending.

- It hosts (node 0) or joins the job's store, so the store outlives every rank; every request it makes there has a
  deadline and yields to a signal (distributed/store_client.py).
- A rank that exits non-zero or dies by a signal stops the others (SIGTERM, then SIGKILL after a grace period) and is
  named in one summary with the root cause's traceback: the earliest failure that is not a mere "lost peer" error
  (supervision/processes/failures.py). A rank that raised counts as failed without waiting for its slow exit.
- Across nodes, a failure is published in the store and every other node stops its ranks, naming it; heartbeats
  (agent/heartbeat.py) name a node that stopped answering, end a node that lost the store, and report slow links.
  Node 0 keeps the store up until the other nodes have ended.
- The ranks die with the supervisor (PR_SET_PDEATHSIG); a reaper kills what they started if it is killed.
- SIGINT stops every rank (exit 130); the first SIGTERM / SIGUSR1 is a preemption notice with a grace period
  (agent/preemption.py), a second one stops every rank (128 + signal); handlers in agent/supervisor_signals.py.
- Restarts (agent/restarts.py): a failed round is followed by a new one, up to ``restarts.max_restarts``; a round's
  ranks are started, polled and stopped by agent/round_ranks.py (``when_up`` runs once they stepped: warm spares).
- Live recovery (``live``, supervision/lighthouse.py): the node is a job of its own (its own store, restarts and exit
  code); node 0's supervisor also runs the lighthouse, the one thing the nodes share.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Set

from fabriclite.distributed import job_secret, rendezvous
from fabriclite.distributed.control_plane import failure_flag, liveness, meeting
from fabriclite.distributed.store_client import StoreClient
from fabriclite.environments.fabriclite_env import child_env
from fabriclite.supervision.rank.child import ERROR_FILE_ENV, SUPERVISOR_PID_ENV, stop_marker
from fabriclite.supervision.processes.failures import Failure, remote_is_root, root_cause, signal_name, summarize
from fabriclite.supervision.watch.goodput import JobRecord, RanksUp
from fabriclite.supervision.watch.hangs import HangWatch, is_hang
from fabriclite.supervision.watch.step_rates import StepRates
from fabriclite.supervision.watch.progress_records import ProgressRecords
from fabriclite.supervision.watch.stragglers import StragglerWatch
from fabriclite.supervision.watch.watcher import RoundView, Watcher
from fabriclite.supervision.agent.output_forwarding import OutputOptions
from fabriclite.supervision.lighthouse import Lighthouse, LiveOptions, wait_reachable
from fabriclite.supervision.agent.node_layout import NodeLayout, Worker
from fabriclite.supervision.agent.preemption import EXIT_PREEMPTED, PreemptOptions, Preemption
from fabriclite.supervision.processes.reaper import Reaper
from fabriclite.supervision.agent.restarts import MAX_RESTARTS_ENV, RestartPolicy, run_rounds
from fabriclite.supervision.agent.round_ranks import POLL_S, RoundRanks
from fabriclite.supervision.agent import heartbeat, supervisor_signals
from fabriclite.supervision.agent.heartbeat import NodeHeartbeat
from fabriclite.supervision.agent.job_store import JobStore
from fabriclite.supervision.processes.stopping import print_summary

DEFAULT_MULTI_NODE_PORT = 29500


class JobFailed(RuntimeError):
    """A rank of the job failed; the message is the supervisor's summary."""

    def __init__(self, summary: str, exit_code: int) -> None:
        super().__init__(summary)
        self.exit_code = exit_code


class Supervisor:
    """Runs this node's ranks: ``run(start)`` calls ``start(local_rank, env)`` once per local rank
    and returns the node's exit code (0 only when every rank here exited 0 and no node failed).

    ``summary``: the one report of a failed job; ``grace_s``: stopped ranks' time from SIGTERM to SIGKILL."""

    def __init__(
        self,
        layout: NodeLayout,
        main_address: str,
        main_port: int,
        timeout: timedelta,
        output: Optional[OutputOptions] = None,
        grace_s: float = 3.0,
        extra_env: Optional[Dict[str, str]] = None,
        report: bool = True,
        restarts: Optional[RestartPolicy] = None,
        preempt: Optional[PreemptOptions] = None,
        live: Optional[LiveOptions] = None,
    ) -> None:
        if layout.num_nodes > 1 and not main_port:
            main_port = DEFAULT_MULTI_NODE_PORT  # every node must agree; one node alone picks a free port
        #: the job secret (None: one node, --insecure, --fault-tolerant); JobSecretError before anything starts
        self.secret = job_secret.for_job(layout.num_nodes, live is not None)
        self.layout = layout
        self.main_address = main_address
        self.main_port = main_port
        self.timeout = timeout
        self.output = output or OutputOptions.from_env()
        self.grace_s = grace_s
        self.extra_env = dict(extra_env or {})
        self.report = report
        self.summary = ""
        self._signal: Optional[int] = None
        self._tmpdir = ""
        #: the round's view of the job's store, the store itself (both StoreClients), the TCPStore under them
        self._store: Any = None
        self._raw_store: Any = None
        self._tcp_store: Any = None
        self.job_store: Optional[JobStore] = None
        #: the heartbeat timeout (control_plane/liveness.py): a node lost for this long ends the job
        self.loss_s = liveness.loss_timeout(timeout.total_seconds())
        #: a node was lost (this one lost the store, or node 0 lost another): no restart can bring it back
        self._lost = False
        self._opening = False
        self._reaper: Optional[Reaper] = None
        self.restarts = restarts or RestartPolicy()
        #: the restart round being played (0: the first start)
        self.round = 0
        self.run_id = rendezvous.run_id()
        self.preemption = Preemption(preempt)
        self.live = live
        self._lighthouse: Optional[Lighthouse] = None
        self._beacon: Optional[heartbeat.LighthouseHeartbeat] = None  # a group's link to a lighthouse elsewhere
        #: the ranks' progress records, read for the watchers (supervision/watch/progress_records.py)
        self.progress = ProgressRecords(layout.global_rank)
        #: this node's pulses, node 0's watch over the others' (agent/heartbeat.py)
        self.heartbeat = NodeHeartbeat(layout.num_nodes, layout.node_rank, layout.local_world_size, main_address,
                                       self.loss_s, self.progress.fewest_steps)
        #: the optimizer-step hang watch and live stacks (supervision/watch/hangs.py)
        self.hangs = HangWatch(layout.node_rank, self.progress, timeout.total_seconds())
        self.hangs.live = live is not None
        self._dump_requested = False
        #: the node's events record (supervision/watch/events.py) and node 0's goodput line (.../goodput.py)
        self.record = JobRecord(layout.node_rank, self.run_id, self.output.log_dir, layout.local_world_size)
        #: when every rank here finished its first step in the round (supervision/watch/goodput.py)
        self.up = RanksUp()
        #: ranks slower than the median, from their busy time (supervision/watch/stragglers.py)
        self.stragglers = StragglerWatch(layout.node_rank, layout.num_nodes,
                                         lambda rank: rank // layout.local_world_size, self.progress)
        #: what the loop hands each read of the ranks' records to, in this order (supervision/watch/watcher.py)
        self.watchers: List[Watcher] = [self.hangs, self.up, self.stragglers, StepRates()]
        #: this node's ranks of the round being played (supervision/agent/round_ranks.py)
        self.ranks = RoundRanks(layout, self.hangs, self._error_file)
        self._when_up: Optional[Callable[[], None]] = None

    # ------------------------------------------------------------------ the job's store
    def _open_store(self) -> None:
        self.job_store = JobStore(self.layout.node_rank, self.main_address, self.main_port, self.timeout, self.secret,
                                  lambda peer, why: self.record.emit("store_refused", peer=peer, why=why))
        self.job_store.open()
        self._tcp_store, self.main_port = self.job_store.tcp, self.job_store.port
        if self.layout.num_nodes > 1 and self.secret is None and self.live is None and self.layout.node_rank == 0:
            job_secret.say_insecure(f"{self.main_address}:{self.main_port}")  # --insecure: one line, node 0
        # every request of this supervisor has a deadline, and none outlasts a signal (distributed/store_client.py)
        self._raw_store = StoreClient(self._tcp_store, f"{self.main_address}:{self.main_port}", self.loss_s,
                                      lambda: self._signal is not None)
        self._store = self._raw_store.view(meeting.job_view(self._tcp_store))  # round 0's (see _play)

    def _open_lighthouse(self, live: LiveOptions) -> None:
        """Node 0 (without --lighthouse) starts the lighthouse; every node waits until it answers (LighthouseError
        naming the address after ``timeout``)."""
        host, port = live.host_port
        if live.host_lighthouse:
            self._lighthouse = Lighthouse(host, port, live.min_replicas, os.path.join(self._tmpdir, "lighthouse.log"))
            self._reaper.watch(self._lighthouse.pid)
            self._lighthouse.wait_ready(self.timeout)
        else:
            wait_reachable(host, port, self.timeout)
            self._beacon = heartbeat.LighthouseHeartbeat(live.group, host, port, self.loss_s)

    def child_env(self, local_rank: int) -> Dict[str, str]:
        """The variables a rank started here runs with (read by FabricliteEnvironment), plus the
        usual RANK / LOCAL_RANK / WORLD_SIZE names for user code, and where to report errors."""
        layout = self.layout
        rank = layout.global_rank(local_rank)
        values = child_env(rank, local_rank, layout.node_rank, layout.world_size, layout.local_world_size,
                           layout.num_nodes, self.main_address, self.main_port)
        values.update({
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(layout.world_size),
            "LOCAL_WORLD_SIZE": str(layout.local_world_size), "NODE_RANK": str(layout.node_rank),
            ERROR_FILE_ENV: self._error_file(local_rank), SUPERVISOR_PID_ENV: str(os.getpid()),
            rendezvous.ROUND_ENV: str(self.round), rendezvous.RUN_ID_ENV: self.run_id,
            MAX_RESTARTS_ENV: str(self.restarts.max_restarts), **self.preemption.options.child_env(),
        })
        if self.live is not None:  # for libraries that shard from them: the job's ranks, every group's (see below)
            values.update(self.live.job_ranks(local_rank, layout.local_world_size))
        values.update(self.record.rank_env())
        values.update(self.job_store.rank_env() if self.job_store is not None else {})
        values.update(self.progress.rank_env(local_rank))
        values.update(self.hangs.rank_env(local_rank, self.extra_env.get("PYTHONPATH",
                                                                          os.environ.get("PYTHONPATH", ""))))
        return {**self.extra_env, **values}

    @property
    def private_fds(self) -> List[int]:
        """File descriptors a rank must not keep open (a forked rank inherits them: close them)."""
        fd = self._reaper.fd if self._reaper is not None else None
        return [] if fd is None else [fd]

    def _error_file(self, local_rank: int) -> str:
        return os.path.join(self._tmpdir, f"error-{self.round}-{local_rank}.json")

    @property
    def _stop_marker(self) -> str:
        return stop_marker(self._error_file(0))

    @property
    def raw_store(self) -> Any:
        """The job's store, unprefixed (node 0 hosts it), each request with a deadline (StoreClient)."""
        return self._raw_store

    def can_restart(self) -> bool:
        """Whether this node may start a new round (not after a signal, nor once a node was lost)."""
        return self._signal is None and not self.preemption.active and not self._lost

    def stopped_code(self, code: int) -> int:
        """The exit code of a failed round that is not restarted: 75 when preempted, else ``code``."""
        return EXIT_PREEMPTED if self.preemption.active else code

    # ------------------------------------------------------------------ running
    def run(self, start: Callable[[int, Dict[str, str]], Worker],
            when_up: Optional[Callable[[], None]] = None) -> int:
        """Open the job's store, start the ranks, watch them; return the node's exit code. ``when_up`` runs once
        per round, when every rank here has finished its first optimizer step (supervision/agent/round_ranks.py).

        Raises RendezvousError (naming address and port) when the store cannot be hosted or joined;
        a signal while joining ends the wait at once (exit code 128 + signal)."""
        self._tmpdir = self.progress.tmpdir = tempfile.mkdtemp(prefix="fabriclite-")
        self._when_up = when_up
        self.record.job_start()
        restore = supervisor_signals.install(self)
        try:
            code = self._open()
            if code is None and self.restarts.max_restarts:
                code = run_rounds(self, lambda number: self._play(start, number), self._report)
            elif code is None:
                code = self._play(start, 0)
            self._stop_all()
            self.output.close()
            code, line = self.preemption.finish(code, self.layout.node_rank)
            self.summary = "\n".join(s for s in (self.summary, line, self._events_line(code)) if s)
            self._report(self.summary)
            goodput = self.record.job_end(code, requeued=code == 0 and self.preemption.active,
                                          mode=self.output.goodput)
            if goodput and self.report:
                print_summary(goodput)
            if self._lighthouse is not None:  # the other groups may still train: keep it up for them
                self._lighthouse.linger(lambda: self._signal is not None)
            self._leave(failed=code != 0)
            return code
        finally:
            self._stop_all()
            if self._lighthouse is not None:
                self._lighthouse.stop()
                if self._reaper is not None:
                    self._reaper.forget(self._lighthouse.pid)
            if self._beacon is not None:
                self._beacon.close()
            if self.job_store is not None:
                self.job_store.close()
            if self._reaper is not None:
                self._reaper.close()
            restore()
            self.output.close()
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _open(self) -> Optional[int]:
        """Open the job's store; None, or the exit code of a signal that arrived meanwhile."""
        self._reaper = Reaper()
        self._opening = True
        try:
            self._open_store()
            if self.live is not None:
                self._open_lighthouse(self.live)
        except supervisor_signals.Interrupted:
            return self._interrupted(self._signal or signal.SIGINT)
        finally:
            self._opening = False
        return None

    def _play(self, start: Callable[[int, Dict[str, str]], Worker], number: int) -> int:
        """Round ``number``: start this node's ranks in that round's part of the store, watch them, stop
        them; the round's exit code (its summary in ``summary``)."""
        assert self._reaper is not None
        self.round, self.summary = number, ""
        self._store = self._raw_store.view(meeting.job_view(self._tcp_store, number))
        if self.layout.num_nodes > 1:
            self.heartbeat.start_round(self._store)
        if os.path.exists(self._stop_marker):
            os.unlink(self._stop_marker)
        self.record.round_start(number, self.restarts.backoff(number - 1) if number else None)
        self.stragglers.store = self._store if self.layout.num_nodes > 1 else None
        self.progress.start_round(number)
        for watcher in self.watchers:
            watcher.start_round(number)
        self.ranks.start(start, self.child_env, self._reaper)
        code = self._watch()
        self._stop_all()
        self.output.close()
        self.record.round_end(code, self.progress.read(list(self.ranks.workers)), self.up.first_step)
        return code

    def _events_line(self, code: int) -> str:
        """After a failed or preempted job: where its events record is (a run folder outside the working directory
        unless --log-dir said otherwise), for ``fabriclite report``."""
        folder = self.record.folder
        if code == 0 or folder is None or self._signal is not None:  # stopped by the user: nothing to say
            return ""
        return f"fabriclite: this run's events are in {folder} (`fabriclite report {folder}` draws them)."

    def _report(self, text: str) -> None:
        if self.report and text:
            if self.live is not None:  # its ranks are numbered inside the group: say which node's group this is
                text = f"fabriclite: replica group {self.live.group} of {self.live.groups} (--fault-tolerant):\n{text}"
            print_summary(text)

    def _watch(self) -> int:
        running = dict(self.ranks.workers)
        failures: List[Failure] = []
        while running:
            if self._signal is not None:
                return self._interrupted(self._signal)
            if self.preemption.expired():
                return self._preempted()
            self.ranks.poll(running, failures)
            if failures:
                self.ranks.collect_more(running, failures, self._remote_failed)
                return self._fail(failures)
            if self._dump_requested:  # SIGQUIT: print the ranks' stacks, the job goes on
                self._dump_requested = False
                self._report(self._stacks("on request (SIGQUIT to the supervisor); the job goes on"))
            view = self.progress.view({r: (w.pid, True) for r, w in running.items()})
            hung = self._observe(view) if view is not None else None
            self.ranks.check_up(self.progress.last, self._when_up)
            if hung is not None:
                return self._hung(hung)
            if self.layout.num_nodes > 1 or self._beacon is not None:
                code = self._heartbeat()
                if code is not None:
                    return code
            time.sleep(POLL_S)
        return 0

    def _heartbeat(self) -> Optional[int]:
        """The heartbeat's word (agent/heartbeat.py): 1 when the round ends here (its summary set), else None; a slow
        link is printed and recorded, the job goes on."""
        outcome = self.heartbeat.tick() if self._beacon is None else self._beacon.tick()
        if isinstance(outcome, heartbeat.Notice):
            if self.report:
                print_summary(outcome.line)
            self.record.emit("slow_link", **outcome.record)
        if not isinstance(outcome, heartbeat.Ending):
            return None
        self._lost = self._lost or outcome.lost
        self.summary = outcome.summary
        if outcome.hang:  # every node reports its own ranks' stacks
            self.summary += "\n" + self._stacks(outcome.hang)
        self.record.failure(outcome.rank, outcome.cause, 1, bool(outcome.hang))
        if outcome.publish:
            self._publish(outcome.publish)
        return 1

    def _observe(self, view: RoundView) -> Optional[str]:
        """Hand ``view`` to every watcher in turn; write their events to the record (node 0 prints their lines).
        Why the round must end (a hang), or None: the caller records that one, with the stacks it takes."""
        ends = None
        for watcher in self.watchers:
            for event in watcher.observe(view):
                if event.ends_round:
                    ends = ends or event.fields.get("reason", event.kind)
                    continue
                if event.line and self.report:
                    print_summary(event.line)
                self.record.emit(event.kind, **event.fields)
        return ends

    def _remote_failed(self) -> bool:
        """Whether another node published a failure (the cause a lost peer here may be reporting); pulses on."""
        if self.layout.num_nodes == 1:
            return False
        self.heartbeat.keep_alive()
        return failure_flag.read_failure(self._store) is not None

    def _fail(self, failures: List[Failure]) -> int:
        remote = failure_flag.read_failure(self._store) if self.layout.num_nodes > 1 else None
        failed = {f.local_rank for f in failures}
        stopping = [self.layout.global_rank(r) for r, w in self.ranks.workers.items()
                    if r not in failed and w.poll() is None]
        self.summary = summarize(failures, remote, self.layout.node_rank, stopping, self.ranks.finished)
        root = root_cause(failures)
        hang = is_hang(root)
        if hang:  # before any SIGTERM: where every live rank is, the stuck one among them
            self.summary += "\n" + (self.hangs.taken or
                                     self._stacks(f"rank {root.global_rank} reported a collective timeout", failed))
        self.record.failure(root.global_rank, root.describe(), root.exit_code, hang)
        if hang:
            self.record.hang(root.error_line, self.hangs.taken or self.summary[self.summary.find("--- live stacks"):])
        if remote_is_root(remote, root, self.layout.node_rank):
            return 1
        failure_flag.publish_failure(self._store, {**root.record(), "hang": hang}, self.layout.num_nodes)
        return root.exit_code

    def _stacks(self, why: str, failed: Set[int] = frozenset()) -> str:  # type: ignore[assignment]
        """Every live rank's stacks and progress (not ``failed`` local ranks': their tracebacks are in the summary)."""
        return self.hangs.stacks(self.ranks.live(failed), why)

    def _hung(self, reason: str) -> int:
        """No rank here completed an optimizer step within the hang timeout: stacks, then stop as a failure."""
        stacks = self._stacks("hung")
        self.summary = f"fabriclite: the job is hung: {reason}.\n" + stacks
        self.record.failure(None, reason, 1, True)
        self.record.hang(reason, stacks)
        self._publish(f"the supervisor of node {self.layout.node_rank} found it hung: {reason}", hang=True)
        return 1

    def _interrupted(self, signum: int) -> int:
        name = signal_name(signum)
        self.summary = f"fabriclite: stopped every rank on node {self.layout.node_rank} on {name}."
        self._publish(f"the supervisor of node {self.layout.node_rank} received {name}")
        return 128 + signum

    def _preempted(self) -> int:
        """The grace period after a preemption signal is over: publish it (the other nodes stop too)."""
        self.summary = self.preemption.expired_summary(self.layout.node_rank)
        self._publish(f"the supervisor of node {self.layout.node_rank} was preempted and stopped its ranks")
        return EXIT_PREEMPTED

    def _publish(self, message: str, **fields: Any) -> None:
        """Publish ``message`` about this node as the job's failure (``rank`` None) for the other nodes."""
        if self._store is not None:
            failure_flag.publish_failure(self._store, {
                "node": self.layout.node_rank, "rank": None, "timestamp": time.time(), "secondary": False,
                "message": message, **fields}, self.layout.num_nodes)

    def _leave(self, failed: bool) -> None:
        """Across nodes, node 0 keeps the store up until the other nodes have ended (control_plane/liveness.py)."""
        if self.layout.num_nodes > 1 and self._store is not None:
            liveness.leave(self._store, self.layout.node_rank, self.layout.num_nodes, failed,
                           lambda: self._signal is not None)

    # ------------------------------------------------------------------ stopping
    def _stop_all(self) -> None:
        """Stop and reap every rank of the round (RoundRanks.stop_all; the summary names ranks that had to be
        SIGKILLed). Idempotent."""
        stubborn = self.ranks.stop_all(self.grace_s, self._stop_marker if self._tmpdir else None, self._reaper)
        if stubborn and self.summary:
            self.summary += (f"\n  ranks {stubborn} did not end within {self.grace_s:g} s of SIGTERM and were "
                             f"killed (SIGKILL).")
