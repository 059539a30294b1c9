"""Rendezvous: the job's key-value store, process-group timeouts, and clear errors for the ways
meeting can fail (port in use, unreachable address, ranks that never arrive).

Lowest layer: imports nothing else of fabriclite, so launchers (which host the store in their
supervisor) and strategies (whose ranks join it) can both use it.
"""
from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import List, Optional, Union

from torch.distributed import PrefixStore, Store, TCPStore

DEFAULT_TIMEOUT = timedelta(minutes=30)
TIMEOUT_ENV = "FABRICLITE_TIMEOUT"
#: key prefix of everything fabriclite keeps in the store (the process group gets its own prefix)
KEY_PREFIX = "fabriclite/"


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

    Raises RuntimeError naming the address and port when the port is taken.
    """
    try:
        return TCPStore(address, port, None, True, timeout, wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, OSError) as err:
        if port and port_in_use(address, port):
            raise RuntimeError(
                f"fabriclite: main port {port} on {address} is already in use by another process. Pick a free "
                f"one (--main-port / MASTER_PORT), or leave it unset on one node to get a free port."
            ) from err
        raise RuntimeError(f"fabriclite: could not start the rendezvous store on {address}:{port}: {err}") from err


def join_store(address: str, port: int, timeout: timedelta) -> TCPStore:
    """Connect to the store server at ``address:port``, retrying until ``timeout``.

    Raises RuntimeError naming the address and port when nobody answers in time.
    """
    start = time.monotonic()
    try:
        return TCPStore(address, port, None, False, timeout)
    except (RuntimeError, OSError) as err:
        waited = time.monotonic() - start
        raise RuntimeError(
            f"fabriclite: could not reach the rendezvous store at {address}:{port} within {waited:.0f} s "
            f"(timeout {timeout.total_seconds():.0f} s). Check that node 0 is started, that {address} is "
            f"reachable from this host and that port {port} is open. ({err})"
        ) from err


def port_in_use(address: str, port: int) -> bool:
    """Whether something already listens on ``address:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        try:
            return sock.connect_ex((address if address not in ("", "0.0.0.0") else "127.0.0.1", port)) == 0
        except OSError:
            return False


def wait_for_ranks(store: Store, key: str, rank: int, world_size: int, timeout: timedelta) -> None:
    """Every rank checks in under ``key``; returns when all ``world_size`` have, else raises a
    RuntimeError listing the ranks that never arrived."""
    store.set(f"{key}/{rank}", "1")
    arrived = store.add(f"{key}/count", 1)
    deadline = time.monotonic() + timeout.total_seconds()
    delay = 0.001
    while arrived < world_size:
        if time.monotonic() > deadline:
            missing = missing_ranks(store, key, world_size)
            raise RuntimeError(
                f"fabriclite: ranks {missing} of {world_size} never joined within {timeout.total_seconds():.0f} s "
                f"(rank {rank} waited). Were all nodes started, with the same --num-nodes/--devices and main "
                f"address/port?"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
        arrived = store.add(f"{key}/count", 0)


def missing_ranks(store: Store, key: str, world_size: int) -> List[int]:
    return [r for r in range(world_size) if not store.check([f"{key}/{r}"])]


def prefixed(store: Store, prefix: str) -> PrefixStore:
    return PrefixStore(prefix, store)


def store_address(address: Optional[str]) -> str:
    return address or "127.0.0.1"
