"""The store in a process of its own, hosted as node 0's supervisor hosts it (fabriclite's ``host_store``: torch's
libuv TCPStore), so that its memory and its request count are its own: requests are counted as the read calls
its process makes (``/proc/<pid>/io`` syscr: the libuv server reads each request of a synchronous client in one
call), checked against a known count at start (:meth:`StoreHost.calibrate`); and a simulated node's connection to it
(:class:`Connection`).

With a job secret, node 0's authenticating relay (fabriclite's ``store_relay.RelayServer``, the real code) runs in a
process of its own in front of the store (:class:`RelayHost`, so that the store's read count stays the store's and
the relay's CPU time is its own), and each worker process's simulated nodes reach it through a real
``store_relay.RelayClient`` in a process of its own (:class:`RelayHost` too): every connection a simulated node
opens proves the secret to node 0's relay on a connection of its own, as a real node's relay does. The secret
reaches these processes on their stdin, never in argv."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Dict

_SERVE = """
import sys, time
from datetime import timedelta
from fabriclite.distributed import rendezvous
store = rendezvous.host_store("127.0.0.1", 0, timedelta(seconds=600))
print(store.port, flush=True)
sys.stdin.read()  # until the parent closes the pipe
"""


_RELAY = """
import sys
from fabriclite.distributed import store_relay
kind, address, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
secret = sys.stdin.readline().strip().encode()
if kind == "server":
    def refused(peer, why):
        print(f"control_plane: node 0's relay refused {peer}: {why}", file=sys.stderr, flush=True)
    relay = store_relay.RelayServer("127.0.0.1", 0, secret, (address, port), refused)
else:
    relay = store_relay.RelayClient(address, port, secret)
print(relay.port, flush=True)
sys.stdin.read()  # until the parent closes the pipe
relay.close()
"""


def _cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system), seconds."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



def _close(proc: subprocess.Popen) -> None:
    """End a child that serves until its stdin closes: close it, wait 10 s, then SIGKILL."""
    if proc.poll() is None:
        proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

class RelayHost:
    """A relay in a process of its own: ``RelayHost("server", store_port, secret)`` is node 0's (on loopback, in
    front of the store at ``store_port``), ``RelayHost("client", server_port, secret)`` a node's relay to it.
    ``port`` is where it listens; ``cpu_s()`` its CPU time so far; ``close()``."""

    def __init__(self, kind: str, port: int, secret: bytes) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _RELAY, kind, "127.0.0.1", str(port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.proc.stdin.write(secret.decode() + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line.strip():
            raise RuntimeError(f"the {kind} relay process did not start")
        self.port = int(line)

    def __enter__(self) -> "RelayHost":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def cpu_s(self) -> float:
        return _cpu_s(self.proc.pid)

    def close(self) -> None:
        _close(self.proc)


class StoreHost:
    """``with StoreHost() as host``: ``host.port``, ``host.client()``, ``host.rss_mb()``, ``host.reads()``."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line.strip():
            raise RuntimeError("the store process did not start")
        self.port = int(line)
        self._client: Any = None
        self.reads_per_request = 1.0

    def __enter__(self) -> "StoreHost":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        _close(self.proc)

    def client(self) -> Any:
        """A new client connection (torch's TCPStore)."""
        from torch.distributed import TCPStore

        return TCPStore("127.0.0.1", self.port, None, False, timedelta(seconds=600))

    @property
    def probe(self) -> Any:
        """The controller's own connection (for num_keys)."""
        if self._client is None:
            self._client = self.client()
        return self._client

    def rss_mb(self) -> float:
        """The store process's resident memory, MB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def cpu_s(self) -> float:
        """The store process's CPU time so far (user + system), seconds."""
        return _cpu_s(self.proc.pid)

    def reads(self) -> int:
        """Read calls the store process has made (see the module docstring)."""
        with open(f"/proc/{self.proc.pid}/io") as f:
            values: Dict[str, int] = dict((k, int(v)) for k, v in (line.split(":") for line in f))
        return values["syscr"]

    def requests(self) -> float:
        """Requests the store has served so far, estimated from its read calls."""
        return self.reads() / self.reads_per_request

    def calibrate(self, count: int = 4000) -> float:
        """Send ``count`` requests of each kind the models use on one connection; the store's read calls per
        request (1.0 expected), kept to scale :meth:`requests`."""
        probe = self.probe
        before = self.reads()
        for i in range(count // 4):
            probe.add("calibrate/counter", 1)
            probe.set("calibrate/key", "x" * 64)
            probe.check(["calibrate/key"])
            probe.get("calibrate/key")
        time.sleep(0.2)
        self.reads_per_request = (self.reads() - before) / (4 * (count // 4))
        probe.delete_key("calibrate/counter")
        probe.delete_key("calibrate/key")
        return self.reads_per_request

    def num_keys(self) -> int:
        return int(self.probe.num_keys())


class Connection:
    """One client connection to the store, used by one chain at a time (``with conn as store``)."""

    def __init__(self, port: int) -> None:
        from torch.distributed import TCPStore

        self.store = TCPStore("127.0.0.1", port, None, False, timedelta(seconds=600))
        self._lock = threading.Lock()

    def __enter__(self) -> Any:
        self._lock.acquire()
        return self.store

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()
