"""Rendezvous: the job's key-value store, process-group timeouts, and clear errors for the ways
meeting can fail (port in use, unreachable address, ranks that never arrive).

Lowest layer: imports nothing else of fabriclite, so launchers (which host the store in their
supervisor) and strategies (whose ranks join it) can both use it.
"""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Union

from torch.distributed import PrefixStore, Store, TCPStore

DEFAULT_TIMEOUT = timedelta(minutes=30)
TIMEOUT_ENV = "FABRICLITE_TIMEOUT"
#: key prefix of everything fabriclite keeps in the store (the process group gets its own prefix)
KEY_PREFIX = "fabriclite/"
#: key (under KEY_PREFIX) where a supervisor publishes the job's first failure, for every rank and node
FAILURE_KEY = "failure"
#: the restart round a supervisor started a rank in (0: the first start)
ROUND_ENV = "FABRICLITE_RESTART_COUNT"
#: the job's run id, the same in every round (see run_id)
RUN_ID_ENV = "FABRICLITE_RUN_ID"
_process_run_id = ""


class RendezvousError(RuntimeError):
    """Meeting failed: the port is taken, the main address does not answer, or ranks never arrived.
    The message names the address, port and missing ranks, and how to fix it."""


class JobFailedElsewhere(RuntimeError):
    """Raised in a rank that waits without a deadline when the job's supervisor reports a failure
    (on this node or another); the message is the supervisor's description of that failure."""


def run_id() -> str:
    """The job's run id, safe in file names, the same across restart rounds: ``$FABRICLITE_RUN_ID`` (a
    supervisor sets it for its ranks), else the SLURM job (``$SLURM_ARRAY_JOB_ID_$SLURM_ARRAY_TASK_ID`` or
    ``$SLURM_JOB_ID``: a requeued job keeps it), else torchrun's ``$TORCHELASTIC_RUN_ID``, else one made up
    once per process."""
    global _process_run_id
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        slurm = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    else:
        slurm = env.get("SLURM_JOB_ID", "")
    raw = env.get(RUN_ID_ENV) or slurm or env.get("TORCHELASTIC_RUN_ID", "")
    if not raw:
        if not _process_run_id:
            _process_run_id = f"{time.strftime('%Y%m%d%H%M%S')}-{os.getpid()}-{os.urandom(3).hex()}"
        raw = _process_run_id
    return re.sub(r"[^A-Za-z0-9_.]", "_", raw)


def resolve_timeout(timeout: Union[None, float, int, timedelta]) -> timedelta:
    """The collective / rendezvous timeout: argument > $FABRICLITE_TIMEOUT (seconds) > 30 minutes."""
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None:
            return DEFAULT_TIMEOUT
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds, e.g. {TIMEOUT_ENV}=600.") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise TypeError(f"timeout={timeout!r} must be a number of seconds or a datetime.timedelta.")
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    if timeout.total_seconds() <= 0:
        raise ValueError(f"timeout={timeout!r} must be positive.")
    return timeout


def host_store(address: str, port: int, timeout: timedelta) -> TCPStore:
    """Start the store server at ``address:port`` (port 0: any free port; read ``store.port``).

    Raises RendezvousError naming the address and port when the port is taken.
    """
    try:
        return TCPStore(address, port, None, True, timeout, wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, OSError) as err:
        if port and port_in_use(address, port):
            raise RendezvousError(
                f"fabriclite: main port {port} on {address} is already in use by another process. Pick a free "
                f"one (--main-port / MASTER_PORT), or leave it unset on one node to get a free port."
            ) from err
        raise RendezvousError(f"fabriclite: could not start the rendezvous store on {address}:{port}: {err}") from err


def join_store(address: str, port: int, timeout: timedelta) -> TCPStore:
    """Connect to the store server at ``address:port``, retrying until ``timeout``.

    Waits in Python (so signals are handled while waiting) until something accepts connections at
    ``address:port``, then joins the store. Raises RendezvousError naming the address and port when
    nobody answers in time, or when what answers is not a rendezvous store.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        wait_listening(address, port, timeout)
    except RendezvousError as err:
        raise RendezvousError(
            f"fabriclite: could not reach the rendezvous store at {address}:{port} {err}. Check that "
            f"node 0 is started, that {address} is reachable from this host and that port {port} is open."
        ) from None
    connect_s = min(max(deadline - time.monotonic(), 1.0), 10.0)
    wrong = (f"fabriclite: something answers at {address}:{port}, but it is not a rendezvous store that accepted "
             f"this client{{}}. Check --main-address / --main-port (MASTER_ADDR / MASTER_PORT).")
    # TCPStore's handshake can wait forever on a server that accepts and never answers: bound it here
    result: List[Any] = []
    thread = threading.Thread(target=_connect, args=(address, port, connect_s, result), daemon=True,
                              name="fabriclite-store-connect")
    thread.start()
    thread.join(connect_s + 1.0)
    if not result:
        raise RendezvousError(wrong.format(f" (no answer to the handshake within {connect_s + 1:.0f} s)"))
    if isinstance(result[0], BaseException):
        raise RendezvousError(wrong.format(f" ({result[0]})")) from result[0]
    store = result[0]
    store.set_timeout(timeout)
    return store


def wait_listening(address: str, port: int, timeout: timedelta, alive: Callable[[], bool] = lambda: True) -> None:
    """Return once something accepts TCP connections at ``address:port``, waiting in Python (signals are handled
    meanwhile); RendezvousError "within N s (timeout T s): <why>" when ``timeout`` passes or ``alive()`` turns
    false first."""
    start = time.monotonic()
    deadline = start + timeout.total_seconds()
    delay = 0.05
    while True:
        try:
            socket.create_connection((address, port), timeout=min(2.0, max(0.1, deadline - time.monotonic()))).close()
            return
        except OSError as err:
            if time.monotonic() + delay > deadline or not alive():
                raise RendezvousError(f"within {time.monotonic() - start:.0f} s (timeout "
                                      f"{timeout.total_seconds():.0f} s): {err}") from err
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _connect(address: str, port: int, timeout_s: float, result: List[Any]) -> None:
    try:
        result.append(TCPStore(address, port, None, False, timedelta(seconds=timeout_s)))
    except (RuntimeError, OSError) as err:
        result.append(err)


def port_in_use(address: str, port: int) -> bool:
    """Whether something already listens on ``address:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        try:
            return sock.connect_ex((address if address not in ("", "0.0.0.0") else "127.0.0.1", port)) == 0
        except OSError:
            return False


def wait_for_ranks(store: Store, key: str, rank: int, world_size: int, timeout: timedelta,
                   where: str = "") -> None:
    """Every rank checks in under ``key``; returns when all ``world_size`` have, else raises a
    RendezvousError listing the ranks that never arrived (within ``timeout``), or JobFailedElsewhere
    as soon as a supervisor reports a failure. ``where`` ("address:port") goes into the error."""
    store.set(f"{key}/{rank}", "1")
    arrived = store.add(f"{key}/count", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    delay = 0.001
    while arrived < world_size:
        if time.monotonic() > deadline:
            missing = missing_ranks(store, key, world_size)
            raise RendezvousError(
                f"fabriclite: ranks {missing} of {world_size} never joined the rendezvous"
                f"{' at ' + where if where else ''} within {timeout.total_seconds():.0f} s "
                f"(rank {rank} waited). Were all nodes started, with the same --num-nodes/--devices and main "
                f"address/port?"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
        arrived = store.add(f"{key}/count", 0)
        if delay >= 0.1:
            raise_if_failed(store, "waiting for the other ranks to join")


def missing_ranks(store: Store, key: str, world_size: int) -> List[int]:
    """The ranks of ``range(world_size)`` that have not checked in under ``key``."""
    return [r for r in range(world_size) if not store.check([f"{key}/{r}"])]


def round_store(store: Store, round_number: int) -> Store:
    """The part of the job's store that restart round ``round_number`` uses (round 0: the store itself, so
    jobs without restarts keep their keys): ranks and supervisors of different rounds never share a key."""
    return store if round_number == 0 else PrefixStore(f"round{round_number}", store)


#: where the ranks of each torchrun round meet in the agents' shared store (see launch_namespace)
TORCHELASTIC_KEY = "fabriclite/torchelastic/"


def launch_namespace(store: Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """A key prefix that this start of the job's ranks share and no earlier start used, in a store that outlives
    the ranks and every count they could read (torchrun's: the rank-0 agent keeps one store for every round of the
    rendezvous, and its agents count restarts each for itself, so ``TORCHELASTIC_RESTART_COUNT`` differs between
    ranks of one round after a failure one agent noticed first).

    Rank 0 names a fresh prefix under ``current``; each rank registers a fresh nonce under the prefix it read there;
    rank 0, once all ``world_size`` ranks have, publishes their nonces as ``go``. A rank that read a prefix of an
    earlier start (its ``go`` lacks this rank's nonce) reads ``current`` again until rank 0 of its own start has
    named one: earlier starts' ranks are gone before torchrun starts the next ones, so nothing else writes there.
    RendezvousError naming the missing ranks after ``timeout``."""
    nonce = os.urandom(8).hex()
    if rank == 0:
        store.set(f"{TORCHELASTIC_KEY}current", nonce)
    deadline = time.monotonic() + timeout.total_seconds()
    name, delay = None, 0.001
    while True:
        if time.monotonic() > deadline:
            waited = f"within {timeout.total_seconds():.0f} s (rank {rank} of {world_size} waited)"
            if name is None or store.check([f"{TORCHELASTIC_KEY}{name}/go"]):
                raise RendezvousError(f"fabriclite: rank 0 of this start never named its part of torchrun's store "
                                      f"{waited}; the part named there, if any, is an earlier start's. Did rank 0's "
                                      "worker start (its agent's log)?")
            missing = [r for r in range(world_size) if not store.check([f"{TORCHELASTIC_KEY}{name}/member/{r}"])]
            raise RendezvousError(f"fabriclite: ranks {missing} never met in torchrun's store {waited}.")
        if store.check([f"{TORCHELASTIC_KEY}current"]):
            current = store.get(f"{TORCHELASTIC_KEY}current").decode()
            if current != name:
                name = current
                store.set(f"{TORCHELASTIC_KEY}{name}/member/{rank}", nonce)
            base = f"{TORCHELASTIC_KEY}{name}/"
            if rank == 0 and not store.check([base + "go"]) and \
                    store.check([f"{base}member/{r}" for r in range(world_size)]):
                members = [store.get(f"{base}member/{r}").decode() for r in range(world_size)]
                store.set(base + "go", json.dumps(members))
            if store.check([base + "go"]):
                members = json.loads(store.get(base + "go"))
                if rank < len(members) and members[rank] == nonce:
                    return f"{TORCHELASTIC_KEY}{name}/"
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def prefixed(store: Store, prefix: str) -> PrefixStore:
    """``store`` seen under ``prefix`` (fabriclite's keys live under KEY_PREFIX)."""
    return PrefixStore(prefix, store)


# ---------------------------------------------------------------------- the job's failure flag
def read_failure(store: Store) -> Optional[Dict[str, Any]]:
    """The failure a supervisor published (keys: node, rank, message, timestamp, secondary), or None.

    ``store`` is prefixed with KEY_PREFIX. A store that cannot be reached counts as a failure (its
    host, node 0's supervisor, is gone)."""
    try:
        if not store.check([FAILURE_KEY]):
            return None
        return json.loads(store.get(FAILURE_KEY))
    except RuntimeError as err:
        return {"node": None, "rank": None, "timestamp": time.time(), "secondary": False,
                "message": f"the job's rendezvous store is gone (its supervisor ended?): {err}"}


def publish_failure(store: Store, record: Dict[str, Any]) -> None:
    """Publish ``record`` as the job's failure unless one is there already; a root cause
    (``secondary`` False) replaces a secondary one. Never raises."""
    try:
        old = read_failure(store)
        if old is None or (old.get("secondary") and not record.get("secondary")):
            store.set(FAILURE_KEY, json.dumps(record))
    except RuntimeError:
        pass


def describe_failure(record: Dict[str, Any]) -> str:
    """"node 1: rank 3 (local rank 1, node 1) raised ValueError: boom" for a published record."""
    where = f"node {record['node']}: " if record.get("node") is not None else ""
    return f"{where}{record['message']}"


def raise_if_failed(store: Store, what: str) -> None:
    """Raise JobFailedElsewhere if a supervisor has reported a failure of the job."""
    record = read_failure(store)
    if record is not None:
        raise JobFailedElsewhere(f"fabriclite: stopped {what}: the job failed on {describe_failure(record)}")


def wait_for_key(store: Store, key: str, what: str, poll_s: float = 0.05) -> None:
    """Wait, without a deadline, until ``key`` is set in ``store`` (prefixed with KEY_PREFIX).

    For waits that are not faults however long they take (rank 0 first, a checkpoint being
    written): instead of a timeout, it raises JobFailedElsewhere (naming the failed node and rank)
    as soon as the job's supervisor reports a failure. ``what`` says what is awaited, for the error.
    """
    delay = 0.001
    while not store.check([key]):
        time.sleep(delay)
        delay = min(delay * 2, poll_s)
        if delay >= poll_s:
            raise_if_failed(store, what)
