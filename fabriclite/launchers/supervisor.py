"""The supervisor: starts one node's ranks, watches them, and turns the first failure anywhere in
the job into one clear ending.

- It hosts (node 0) or joins (other nodes) the job's rendezvous store, so the store outlives every
  rank; ranks connect to it as clients.
- A rank that exits non-zero or dies by a signal stops the others (SIGTERM, then SIGKILL after a
  grace period), is named in one summary with the first failing rank's traceback (from the error
  file each rank writes), and the supervisor's exit code is non-zero.
- Across nodes, a failure is published in the store; every other node's supervisor polls it and
  stops its ranks, naming the failed node and rank.
- SIGINT / SIGTERM to the supervisor stop every rank; exit code 130 / 143.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Protocol

from fabriclite import rendezvous
from fabriclite.launchers.child import ERROR_FILE_ENV, SUPERVISOR_PID_ENV
from fabriclite.launchers.output import OutputOptions

FAILURE_KEY = "failure"
POLL_S = 0.05
REMOTE_POLL_S = 0.5
DEFAULT_MULTI_NODE_PORT = 29500


class Worker(Protocol):
    pid: int

    def poll(self) -> Optional[int]:
        """None while running, else the exit code (negative: killed by that signal)."""


@dataclass(frozen=True)
class Layout:
    """Where this node's ranks sit in the job."""

    num_nodes: int
    node_rank: int
    local_world_size: int

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.local_world_size

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.local_world_size + local_rank


@dataclass
class Failure:
    node_rank: int
    global_rank: int
    local_rank: int
    returncode: int
    traceback: str = ""
    timestamp: float = field(default_factory=time.time)

    def describe(self) -> str:
        how = (f"was killed by {_signal_name(-self.returncode)}" if self.returncode < 0
               else f"exited with code {self.returncode}")
        return f"rank {self.global_rank} (local rank {self.local_rank}, node {self.node_rank}) {how}"


class JobFailed(RuntimeError):
    """A rank of the job failed; the message is the supervisor's summary."""

    def __init__(self, summary: str, exit_code: int) -> None:
        super().__init__(summary)
        self.exit_code = exit_code


class Supervisor:
    """Runs this node's ranks: ``run(start)`` calls ``start(local_rank, env)`` once per local rank
    and returns the node's exit code (0 only when every rank here exited 0 and no node failed)."""

    def __init__(
        self,
        layout: Layout,
        main_address: str,
        main_port: int,
        timeout: timedelta,
        output: Optional[OutputOptions] = None,
        grace_s: float = 3.0,
        extra_env: Optional[Dict[str, str]] = None,
    ) -> None:
        if layout.num_nodes > 1 and not main_port:
            main_port = DEFAULT_MULTI_NODE_PORT  # every node must agree; one node alone picks a free port
        self.layout = layout
        self.main_address = main_address
        self.main_port = main_port
        self.timeout = timeout
        self.output = output or OutputOptions.from_env()
        self.grace_s = grace_s
        self.extra_env = dict(extra_env or {})
        self.summary = ""
        self._signal: Optional[int] = None
        self._workers: Dict[int, Worker] = {}
        self._tmpdir = ""
        self._store: Any = None
        self._raw_store: Any = None

    # ------------------------------------------------------------------ the job's store
    def _open_store(self) -> None:
        if self.layout.node_rank == 0:
            self._raw_store = rendezvous.host_store("0.0.0.0", self.main_port, self.timeout)
            self.main_port = self._raw_store.port
        else:
            self._raw_store = rendezvous.join_store(self.main_address, self.main_port, self.timeout)
        self._store = rendezvous.prefixed(self._raw_store, rendezvous.KEY_PREFIX)

    def child_env(self, local_rank: int) -> Dict[str, str]:
        """The variables a rank started here runs with (read by FabricliteEnvironment)."""
        rank = self.layout.global_rank(local_rank)
        values = {
            "FABRICLITE_RANK": rank,
            "FABRICLITE_LOCAL_RANK": local_rank,
            "FABRICLITE_NODE_RANK": self.layout.node_rank,
            "FABRICLITE_WORLD_SIZE": self.layout.world_size,
            "FABRICLITE_LOCAL_WORLD_SIZE": self.layout.local_world_size,
            "FABRICLITE_NUM_NODES": self.layout.num_nodes,
            "MASTER_ADDR": self.main_address,
            "MASTER_PORT": self.main_port,
            # the usual names too, for user code that reads them
            "RANK": rank,
            "LOCAL_RANK": local_rank,
            "WORLD_SIZE": self.layout.world_size,
            "LOCAL_WORLD_SIZE": self.layout.local_world_size,
            "NODE_RANK": self.layout.node_rank,
            ERROR_FILE_ENV: self._error_file(local_rank),
            SUPERVISOR_PID_ENV: os.getpid(),
        }
        return {**self.extra_env, **{k: str(v) for k, v in values.items()}}

    def _error_file(self, local_rank: int) -> str:
        return os.path.join(self._tmpdir, f"error-{local_rank}.json")

    # ------------------------------------------------------------------ running
    def run(self, start: Callable[[int, Dict[str, str]], Worker]) -> int:
        self._tmpdir = tempfile.mkdtemp(prefix="fabriclite-")
        restore = self._install_signal_handlers()
        try:
            self._open_store()
            for local_rank in range(self.layout.local_world_size):
                self._workers[local_rank] = start(local_rank, self.child_env(local_rank))
            return self._watch()
        finally:
            self._stop_all()
            restore()
            self.output.close()
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def _watch(self) -> int:
        running = dict(self._workers)
        failures: List[Failure] = []
        next_remote = time.monotonic() + REMOTE_POLL_S
        while running:
            if self._signal is not None:
                self.summary = f"fabriclite: stopped every rank on {_signal_name(self._signal)}."
                return 128 + self._signal
            for local_rank, worker in list(running.items()):
                code = worker.poll()
                if code is None:
                    continue
                del running[local_rank]
                if code != 0:
                    failures.append(self._failure(local_rank, code))
            if failures:
                # give ranks that failed at nearly the same time a moment to be seen too
                self._collect_more(running, failures)
                return self._fail(failures)
            if self.layout.num_nodes > 1 and time.monotonic() >= next_remote:
                next_remote = time.monotonic() + REMOTE_POLL_S
                remote = self._remote_failure()
                if remote:
                    self.summary = remote
                    return 1
            time.sleep(POLL_S)
        self._finish_ok()
        return 0

    def _collect_more(self, running: Dict[int, Worker], failures: List[Failure]) -> None:
        time.sleep(0.1)
        for local_rank, worker in list(running.items()):
            code = worker.poll()
            if code is not None:
                del running[local_rank]
                if code != 0:
                    failures.append(self._failure(local_rank, code))

    def _failure(self, local_rank: int, code: int) -> Failure:
        failure = Failure(self.layout.node_rank, self.layout.global_rank(local_rank), local_rank, code)
        try:
            with open(self._error_file(local_rank)) as f:
                record = json.load(f)
            failure.traceback = record.get("traceback", "")
            failure.timestamp = float(record.get("timestamp", failure.timestamp))
        except (OSError, ValueError):
            pass
        return failure

    def _fail(self, failures: List[Failure]) -> int:
        # the root cause is the earliest recorded error, as torchelastic's error files do
        first = min(failures, key=lambda f: (not f.traceback, f.timestamp))
        lines = [f"fabriclite: the job failed: {first.describe()}."]
        lines += [f"  also: {f.describe()}" for f in failures if f is not first]
        others = [self.layout.global_rank(r) for r in self._workers if self._workers[r].poll() is None]
        if others:
            lines.append(f"  stopping ranks {others} on node {self.layout.node_rank}.")
        if first.traceback:
            lines.append(f"--- rank {first.global_rank} traceback ---")
            lines.append(first.traceback.rstrip())
        self.summary = "\n".join(lines)
        self._publish_failure(first)
        code = first.returncode
        return code if code > 0 else 128 + (-code if code < 0 else 1)

    # ------------------------------------------------------------------ across nodes
    def _publish_failure(self, failure: Failure) -> None:
        if self._store is None or self.layout.num_nodes == 1:
            return
        message = failure.describe()
        if failure.traceback:
            message += "\n" + failure.traceback.strip().splitlines()[-1]
        try:
            self._store.set(FAILURE_KEY, json.dumps({"node": failure.node_rank, "message": message}))
        except RuntimeError:
            pass

    def _remote_failure(self) -> Optional[str]:
        try:
            if not self._store.check([FAILURE_KEY]):
                return None
            record = json.loads(self._store.get(FAILURE_KEY))
            return (f"fabriclite: the job failed on node {record['node']}: {record['message']}\n"
                    f"  stopping the ranks of node {self.layout.node_rank}.")
        except RuntimeError as err:
            return (f"fabriclite: lost the rendezvous store at {self.main_address}:{self.main_port} (node 0's "
                    f"supervisor is gone: {err}); stopping the ranks of node {self.layout.node_rank}.")

    def _finish_ok(self) -> None:
        """Node 0 keeps the store up until every node is done (or has failed)."""
        if self.layout.num_nodes == 1 or self._store is None:
            return
        try:
            self._store.add("nodes_done", 1)
            if self.layout.node_rank != 0:
                return
            deadline = time.monotonic() + 60
            while self._store.add("nodes_done", 0) < self.layout.num_nodes and time.monotonic() < deadline:
                if self._store.check([FAILURE_KEY]) or self._signal is not None:
                    return
                time.sleep(0.05)
        except RuntimeError:
            pass

    # ------------------------------------------------------------------ stopping
    def _stop_all(self) -> None:
        alive = [w for w in self._workers.values() if w.poll() is None]
        for worker in alive:
            _kill_group(worker.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while any(w.poll() is None for w in alive) and time.monotonic() < deadline:
            time.sleep(0.02)
        for worker in self._workers.values():  # anything left, grandchildren included
            _kill_group(worker.pid, signal.SIGKILL)
        for worker in self._workers.values():
            _reap(worker)

    def _install_signal_handlers(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def handler(signum: int, frame: Any) -> None:
            self._signal = signum

        for s in previous:
            signal.signal(s, handler)

        def restore() -> None:
            for s, h in previous.items():
                signal.signal(s, h)

        return restore


def _kill_group(pid: int, sig: int) -> None:
    """Signal the rank's process group (the rank and what it started); the rank alone if it has not
    made its own group yet."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(worker: Worker) -> None:
    deadline = time.monotonic() + 5
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def print_summary(summary: str) -> None:
    if summary:
        print(summary, file=sys.stderr, flush=True)
