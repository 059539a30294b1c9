"""Rendezvous: hosting and joining the job's key-value store, process-group timeouts, the run's id, and clear
errors for the ways meeting can fail (port in use, unreachable address). What is said through the store once it
is up (who arrived, the failure flag, heartbeats, restarts) is ``control_plane``'s.

Lowest layer: imports nothing else of fabriclite, so launchers (which host the store in their
supervisor) and strategies (whose ranks join it) can both use it.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import re
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Union

from torch.distributed import TCPStore

DEFAULT_TIMEOUT = timedelta(minutes=30)
TIMEOUT_ENV = "FABRICLITE_TIMEOUT"
#: the restart round a supervisor started a rank in (0: the first start)
ROUND_ENV = "FABRICLITE_RESTART_COUNT"
#: the job's run id, the same in every round (see run_id)
RUN_ID_ENV = "FABRICLITE_RUN_ID"
_process_run_id = ""


class RendezvousError(RuntimeError):
    """Meeting failed: the port is taken, the main address does not answer, or ranks never arrived.
    The message names the address, port and missing ranks, and how to fix it."""


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
    """Start the store server at ``address:port`` (port 0: any free port; read ``store.port``), listening on that
    address alone (``listener``): torch's own server listens on every interface whatever host it is given.

    Raises RendezvousError naming the address and port when the port is taken.
    """
    try:
        sock = listener(address, port)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise RendezvousError(port_taken(address, port)) from err
        raise RendezvousError(f"fabriclite: could not start the rendezvous store on {address}:{port}: {err}") from err
    try:
        if sock is None:
            return TCPStore(address, port, None, True, timeout, wait_for_workers=False, multi_tenant=True)
        bound = sock.getsockname()[1]
        return TCPStore(address, bound, None, True, timeout, wait_for_workers=False, multi_tenant=True,
                        master_listen_fd=sock.detach())
    except (RuntimeError, OSError) as err:
        if port and port_in_use(address, port):
            raise RendezvousError(port_taken(address, port)) from err
        raise RendezvousError(f"fabriclite: could not start the rendezvous store on {address}:{port}: {err}") from err


def port_taken(address: str, port: int) -> str:
    """The error for a main port that another process holds."""
    return (f"fabriclite: main port {port} on {address} is already in use by another process. Pick a free one "
            f"(--main-port / MASTER_PORT), or leave it unset on one node to get a free port.")


def listener(address: str, port: int) -> Optional[socket.socket]:
    """A socket listening on ``address:port`` alone (the narrowest address that works), or None where no single
    address can be chosen and the caller listens on every interface: an unspecified address (``0.0.0.0``, ``::``,
    ""), a name that resolves to loopback here but is not loopback by name (Debian maps a host's own name to
    127.0.1.1, while the other nodes reach that name at its real address), a name that does not resolve, or an
    address that is not this host's. OSError (EADDRINUSE) when the port is taken."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(address or None, port, type=socket.SOCK_STREAM)[0]
        ip = ipaddress.ip_address(where[0].split("%")[0])
    except (OSError, ValueError, IndexError):
        return None
    if ip.is_unspecified or (ip.is_loopback and not is_loopback_name(address)):
        return None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRNOTAVAIL:  # not an address of this host (a name for a virtual address)
            return None
        raise
    return sock


def is_loopback_name(address: str) -> bool:
    """Whether ``address`` names loopback by itself: ``localhost``, ``127.x.y.z``, ``::1``."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def join_store(address: str, port: int, timeout: timedelta) -> TCPStore:
    """Connect to the store server at ``address:port``, retrying until ``timeout``.

    Waits in Python (so signals are handled while waiting) until something accepts connections at
    ``address:port``, then joins the store. Raises RendezvousError naming the address and port when
    nobody answers in time, or when what answers is not a rendezvous store.
    """
    connect_s = reach(address, port, timeout)
    # TCPStore's handshake can wait forever on a server that accepts and never answers: bound it here
    result: List[Any] = []
    thread = threading.Thread(target=_connect, args=(address, port, connect_s, result), daemon=True,
                              name="fabriclite-store-connect")
    thread.start()
    thread.join(connect_s + 1.0)
    if not result:
        raise RendezvousError(not_a_store(address, port, f"no answer to the handshake within {connect_s + 1:.0f} s"))
    if isinstance(result[0], BaseException):
        raise RendezvousError(not_a_store(address, port, str(result[0]))) from result[0]
    store = result[0]
    store.set_timeout(timeout)
    return store


def reach(address: str, port: int, timeout: timedelta) -> float:
    """Wait (signals handled) until something accepts connections at ``address:port``; the seconds a handshake
    there may then take (what is left of ``timeout``, 1 to 10 s). RendezvousError naming the address, the port and
    what to check when nobody answers within ``timeout``."""
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        wait_listening(address, port, timeout)
    except RendezvousError as err:
        raise RendezvousError(
            f"fabriclite: could not reach the rendezvous store at {address}:{port} {err}. Check that "
            f"node 0 is started, that {address} is reachable from this host and that port {port} is open."
        ) from None
    return min(max(deadline - time.monotonic(), 1.0), 10.0)


def not_a_store(address: str, port: int, why: str) -> str:
    """The error for a main address and port where something answers that is not the job's store."""
    return (f"fabriclite: something answers at {address}:{port}, but it is not a rendezvous store that accepted "
            f"this client ({why}). Check --main-address / --main-port (MASTER_ADDR / MASTER_PORT).")


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
