"""A pool of real ranks for tests: N spawned processes that joined one gloo process group through
``Fabric`` (as children of a supervisor would), reused across many tests.

``pool.run(fn, *args)`` runs ``fn(fabric, *args)`` on every rank (``fn`` must be a module-level
function) and returns the results in rank order; if any rank raised, it raises ``RankError`` with
every failing rank's traceback. A call that takes longer than ``timeout`` kills the pool (it is
restarted on the next call) and fails the test: a hang never blocks the suite.

Inside the ranks, ``agree(verdict_group(), example, detail)`` makes every rank raise together when any rank's
check failed, naming each failed rank: through raw torch.distributed on a group of its own, so a test of
fabriclite's collectives never trusts them to report their own failure.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Dict, List, Optional, Tuple

from fabriclite.distributed import rendezvous
from fabriclite.supervision.rank.child import die_with_parent


def verdict_group() -> Any:
    """A gloo group of every rank (call on every rank), apart from the group the code under test uses."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def agree(group: Any, example: Any, detail: str) -> None:
    """Every rank learns every rank's verdict (``detail``: '' when this rank's check passed) through ``group``
    with raw torch.distributed, then all raise together, naming ``example`` and each failed rank's reason."""
    import torch.distributed as dist

    verdicts: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(verdicts, detail, group=group)
    failed = [f"rank {r}: {why}" for r, why in enumerate(verdicts) if why]
    assert not failed, f"example {example!r} failed on " + "; ".join(failed)


class RankError(AssertionError):
    """One or more ranks raised; the message holds their tracebacks."""

    def __init__(self, errors: Dict[int, str]) -> None:
        self.errors = errors
        super().__init__("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))


class RankPool:
    def __init__(self, world_size: int, timeout: float = 120.0, collective_timeout: float = 60.0) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.collective_timeout = collective_timeout
        self._procs: List[mp.process.BaseProcess] = []
        self._conns: List[Connection] = []
        self._store: Any = None

    def start(self) -> None:
        from datetime import timedelta

        ctx = mp.get_context("spawn")
        self._store = rendezvous.host_store("127.0.0.1", 0, timedelta(seconds=60))
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            env = {
                "FABRICLITE_RANK": str(rank), "FABRICLITE_LOCAL_RANK": str(rank), "FABRICLITE_NODE_RANK": "0",
                "FABRICLITE_WORLD_SIZE": str(self.world_size), "FABRICLITE_LOCAL_WORLD_SIZE": str(self.world_size),
                "FABRICLITE_NUM_NODES": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self._store.port),
                "FABRICLITE_TIMEOUT": str(self.collective_timeout), "OMP_NUM_THREADS": "1",
            }
            proc = ctx.Process(target=_worker, args=(env, child, os.getpid()), daemon=True,
                               name=f"pool-rank-{rank}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(None, "start-up")

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any) -> List[Any]:
        if not self.alive:
            self.close()
            self.start()
        for conn in self._conns:
            conn.send((fn, args))
        return self._collect(fn, getattr(fn, "__name__", repr(fn)))

    def _collect(self, fn: Optional[Callable[..., Any]], what: str) -> List[Any]:
        results: Dict[int, Tuple[str, Any]] = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        import time

        deadline = time.monotonic() + self.timeout
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending), timeout=max(0.0, left))
            if not ready:
                missing = sorted(pending.values())
                self.close()
                raise TimeoutError(f"ranks {missing} did not finish {what} within {self.timeout} s; pool restarted")
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    results[rank] = conn.recv()
                except EOFError:
                    results[rank] = ("err", "rank process died")
        errors = {r: v for r, (kind, v) in results.items() if kind == "err"}
        if errors:
            if any(v == "rank process died" for v in errors.values()):
                self.close()
            raise RankError(errors)
        return [results[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._conns = [], []
        self._store = None


def _worker(env: Dict[str, str], conn: Connection, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    os.environ.update(env)
    from fabriclite import Fabric

    try:
        fabric = Fabric(accelerator="cpu", devices=int(env["FABRICLITE_WORLD_SIZE"]))
        fabric.launch()
        conn.send(("ok", None))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        fn, args = message
        try:
            conn.send(("ok", fn(fabric, *args)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))
