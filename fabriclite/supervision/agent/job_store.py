"""The job's store as one node's supervisor opens it: hosted (node 0) or joined, behind the job secret's relay.

- No secret (one node, ``--insecure``, ``--fault-tolerant``): node 0 hosts torch's TCPStore on the main address
  (narrowly bound: ``rendezvous.listener``) and everyone connects there, as before.
- A secret (distributed/job_secret.py): node 0 hosts the store on loopback and a ``RelayServer`` on the main
  address; every other node first proves the secret once (a wrong one ends the node at once, naming node 0's
  address and the job secret), then runs a ``RelayClient`` on its loopback, through which its supervisor and its
  ranks reach the store. ``endpoint`` is where this node's ranks connect (``$FABRICLITE_STORE_ADDR`` / ``_PORT``).
"""
from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Optional, Set, Tuple

from fabriclite.distributed import rendezvous, store_relay
from fabriclite.environments.fabriclite_env import STORE_ADDRESS_VAR, STORE_PORT_VAR

LOOPBACK = "127.0.0.1"


class JobStore:
    """This node's way to the job's store. After ``open()``: ``tcp`` (the TCPStore this supervisor uses),
    ``port`` (the main port the nodes meet on) and ``endpoint`` (where this node's ranks connect).
    ``on_refused(peer, why)``: node 0's relay turned a connection away (called once per peer host and reason,
    on the relay's thread)."""

    def __init__(self, node_rank: int, main_address: str, main_port: int, timeout: timedelta,
                 secret: Optional[bytes], on_refused: Optional[Callable[[str, str], None]] = None) -> None:
        self.node_rank, self.main_address, self.port, self.timeout = node_rank, main_address, main_port, timeout
        self.secret, self.on_refused = secret, on_refused
        self.tcp: Any = None
        self.endpoint: Tuple[str, int] = (main_address, main_port)
        self._relay: Optional[store_relay._Relay] = None
        self._refusals: Set[Tuple[str, str]] = set()
        self._lock = threading.Lock()

    def open(self) -> None:
        """Host or join the store (RendezvousError naming the address and port; JobSecretRefused, a
        RendezvousError, when node 0 refuses this node's secret)."""
        if self.node_rank == 0:
            self._host()
        else:
            self._join()

    def _host(self) -> None:
        if self.secret is None:
            self.tcp = rendezvous.host_store(self.main_address, self.port, self.timeout)
            self.port = self.tcp.port
            self.endpoint = (self.main_address, self.port)
            return
        self.tcp = rendezvous.host_store(LOOPBACK, 0, self.timeout)
        self._relay = store_relay.RelayServer(self.main_address, self.port, self.secret, (LOOPBACK, self.tcp.port),
                                              self._refused)
        self.port = self._relay.port
        self.endpoint = (LOOPBACK, self.tcp.port)

    def _join(self) -> None:
        if self.secret is None:
            self.tcp = rendezvous.join_store(self.main_address, self.port, self.timeout)
            return
        store_relay.verify_secret(self.main_address, self.port, self.secret, self.timeout.total_seconds())
        self._relay = store_relay.RelayClient(self.main_address, self.port, self.secret)
        self.endpoint = (LOOPBACK, self._relay.port)
        self.tcp = rendezvous.join_store(LOOPBACK, self._relay.port, self.timeout)

    def rank_env(self) -> dict:
        """Where this node's ranks reach the store, when that is not the main address (behind a relay)."""
        if self._relay is None:
            return {}
        return {STORE_ADDRESS_VAR: self.endpoint[0], STORE_PORT_VAR: str(self.endpoint[1])}

    def _refused(self, peer: str, why: str) -> None:
        host = peer.rsplit(":", 1)[0]
        with self._lock:
            if (host, why) in self._refusals:
                return
            self._refusals.add((host, why))
        if self.on_refused is not None:
            self.on_refused(peer, why)

    def close(self) -> None:
        """Stop the relay (the store itself ends with the process)."""
        if self._relay is not None:
            self._relay.close()
            self._relay = None
