"""Live recovery (``fabriclite run --fault-tolerant``): the options every node's supervisor and rank share, and
torchft's lighthouse in its own process.

- Each node is one torchft replica group with its own supervisor, its own store (on its own node, a free port)
  and its own ``--max-restarts`` budget: a failure stays on its node. The only thing shared across nodes is
  the lighthouse, which agrees the quorum of live groups.
- Node 0's supervisor starts the lighthouse (torchft's ``torchft_lighthouse`` command, in its own process,
  never inside a rank) at ``--main-address`` on ``--main-port`` itself, before its ranks, and keeps it up
  through its ranks' failures and restarts until every other group has finished or given up (no group has
  heartbeated for ``LINGER_S``). ``--lighthouse HOST:PORT`` names an external one instead; node 0 then starts
  none.
- A job starts together: its first quorum (no group has committed a step yet) must hold every group started with
  it (``--num-nodes``); a rank whose first quorum lacks some groups asks again, within ``--first-quorum-timeout``
  (:data:`FIRST_QUORUM_TIMEOUT_S` by default), and then fails naming the groups that never joined
  (fabriclite.strategies.torchft.replica_strategy). torchft's minimum (``--min-replicas``) applies after that.
- The lighthouse's timeouts (``JOIN_TIMEOUT_MS``, ``HEARTBEAT_TIMEOUT_MS``) drop a lost group from the quorum
  within about a second instead of torchft's one-minute join default. It listens on the main address alone
  (``bind_address``), not on every interface as torchft's own command line suggests.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

from fabriclite.distributed import rendezvous
from fabriclite.distributed.network import local_address_towards
from fabriclite.supervision.rank.child import die_with_parent, load_prctl
from fabriclite.supervision.processes.stopping import kill_group, reap

#: a group whose heartbeat is this old is dead for the lighthouse (torchft's default: 5 s)
HEARTBEAT_TIMEOUT_MS = 1000
#: how long the lighthouse waits for groups that heartbeat but have not asked for the quorum (torchft's: 60 s)
JOIN_TIMEOUT_MS = 300
#: how often the lighthouse tries to form a quorum (torchft's default: 100 ms)
QUORUM_TICK_MS = 50
#: node 0 stops its lighthouse once no group has heartbeated for this long (after its own group ended)
LINGER_S = 3.0
POLL_S = 0.2
#: how long a job's first quorum waits for every group started with it (``--first-quorum-timeout``)
FIRST_QUORUM_TIMEOUT_S = 300.0
#: the rank's environment under --fault-tolerant (LiveOptions.to_env / from_env)
ENV = {"lighthouse": "FABRICLITE_FT_LIGHTHOUSE", "group": "FABRICLITE_FT_GROUP", "groups": "FABRICLITE_FT_GROUPS",
       "min_replicas": "FABRICLITE_FT_MIN_REPLICAS", "address": "FABRICLITE_FT_ADDRESS",
       "first_quorum_timeout": "FABRICLITE_FT_FIRST_QUORUM_TIMEOUT"}
FT_EXTRA = "pip install 'fabriclite[ft]' (torchft 0.2.0 and its pinned requirements)"


class LighthouseError(rendezvous.RendezvousError):
    """The lighthouse could not be started or reached; the message names the address and how to fix it."""


@dataclass(frozen=True)
class LiveOptions:
    """Where this node's replica group sits: ``group`` of ``groups`` (its node rank, the number of nodes), the
    lighthouse ``host:port``, the quorum's minimum, ``address``: this node's address other groups reach
    (its store, its torchft manager and its process group are advertised there), and how long the job's first
    quorum waits for every group (seconds)."""

    lighthouse: str
    group: int
    groups: int
    min_replicas: int = 1
    address: str = "127.0.0.1"
    host_lighthouse: bool = False
    first_quorum_timeout: float = FIRST_QUORUM_TIMEOUT_S

    def to_env(self) -> Dict[str, str]:
        """The variables a rank of this group reads back with :meth:`from_env`."""
        return {ENV[k]: str(getattr(self, k)) for k in ENV}

    @classmethod
    def from_env(cls) -> Optional["LiveOptions"]:
        """The options a supervisor started under --fault-tolerant gave this rank; None outside that mode."""
        if ENV["lighthouse"] not in os.environ:
            return None
        env = os.environ
        return cls(env[ENV["lighthouse"]], int(env[ENV["group"]]), int(env[ENV["groups"]]),
                   int(env[ENV["min_replicas"]]), env[ENV["address"]],
                   first_quorum_timeout=float(env.get(ENV["first_quorum_timeout"], FIRST_QUORUM_TIMEOUT_S)))

    def job_ranks(self, group_rank: int, ranks_per_group: int) -> Dict[str, str]:
        """``RANK`` / ``WORLD_SIZE`` / ``NODE_RANK`` for user code and libraries that shard their data from them
        (a Hugging Face ``split_dataset_by_node``, a WebDataset): the rank among every group's ranks
        (``group * R + group_rank``) and ``groups * R``, so that no two groups read the same share. fabriclite's
        own world (``fabric.world_size``, the collectives) is the group's (``FABRICLITE_*``)."""
        return {"RANK": str(self.group * ranks_per_group + group_rank),
                "WORLD_SIZE": str(self.groups * ranks_per_group), "NODE_RANK": str(self.group)}

    @property
    def host_port(self) -> Tuple[str, int]:
        host, _, port = self.lighthouse.rpartition(":")
        return host.strip("[]"), int(port)


def parse_address(value: str, where: str) -> Tuple[str, int]:
    """``HOST:PORT`` as (host, port); ValueError naming ``where`` otherwise."""
    match = re.fullmatch(r"\[?([^\[\]]+?)\]?:(\d+)", value.strip())
    if not match or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"{where} {value!r}: expected HOST:PORT, e.g. 10.0.0.5:29510.")
    return match.group(1), int(match.group(2))


def advertised_address(towards: str) -> str:
    """This node's address as the other nodes reach it: 127.0.0.1 when ``towards`` (the lighthouse) is on this
    host's loopback, else the local address on the route to it (never the 127.0.1.1 a hostname may map to)."""
    if towards in ("localhost", "::1") or towards.startswith("127."):
        return "127.0.0.1"
    return local_address_towards(towards) or towards


class Lighthouse:
    """torchft's lighthouse in its own process (``torchft_lighthouse``), dying with this supervisor."""

    def __init__(self, host: str, port: int, min_replicas: int, log_path: str) -> None:
        self.host, self.port = host, port
        if rendezvous.port_in_use(host, port):
            raise LighthouseError(f"fabriclite: cannot start the lighthouse: port {port} on {host} is already in "
                                  f"use. Pick a free --main-port, or pass --lighthouse HOST:PORT to use a running one.")
        beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")  # torchft's console script
        command = [beside if os.path.exists(beside) else (shutil.which("torchft_lighthouse") or beside),
                   "--bind", bind_address(host, port), "--min_replicas", str(min_replicas),
                   "--join_timeout_ms", os.environ.get("FABRICLITE_FT_JOIN_TIMEOUT_MS", str(JOIN_TIMEOUT_MS)),
                   "--quorum_tick_ms", str(QUORUM_TICK_MS),
                   "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)]
        parent = os.getpid()
        load_prctl()
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=lambda: die_with_parent(parent),
                                        env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
        self.pid = self.process.pid
        self._log_path = log_path

    def wait_ready(self, timeout: timedelta) -> None:
        """Return once the lighthouse accepts connections; LighthouseError (with its output) if it exits first."""
        try:
            wait_reachable(self.host, self.port, timeout, alive=lambda: self.process.poll() is None)
        except LighthouseError as err:
            self.stop()
            with open(self._log_path, errors="replace") as log:
                tail = log.read()[-2000:]
            raise LighthouseError(f"{err}\n  the lighthouse's output:\n{tail}") from None

    def groups_alive(self) -> Optional[List[str]]:
        """The replica groups the lighthouse has heard from within its heartbeat timeout (from its status
        page); None when it does not answer."""
        return status_groups(self.host, self.port)

    def linger(self, stop_waiting: Callable[[], bool]) -> None:
        """Keep the lighthouse up until no group has heartbeated for LINGER_S (every other group finished or
        gave up), or ``stop_waiting()`` (a signal to this supervisor)."""
        quiet_since = time.monotonic()
        while not stop_waiting() and self.process.poll() is None:
            alive = self.groups_alive()
            if alive:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= LINGER_S:
                return
            time.sleep(POLL_S)

    def stop(self) -> None:
        """End the lighthouse process (idempotent)."""
        if self.process.poll() is None:
            kill_group(self.pid, 15)
            deadline = time.monotonic() + 2
            while self.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        kill_group(self.pid, 9)
        reap(self)
        self._log.close()

    def poll(self) -> Optional[int]:
        return self.process.poll()


def bind_address(host: str, port: int) -> str:
    """What the lighthouse listens on: ``host``'s address alone (rendezvous.listener's rule), or every interface
    where no single address can be chosen (a name that resolves to loopback here only)."""
    sock = rendezvous.listener(host, port)
    if sock is None:
        return f"[::]:{port}"
    address = sock.getsockname()[0]
    sock.close()
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def status_groups(host: str, port: int) -> Optional[List[str]]:
    """The replica ids (``group_<i>:<uuid>``) the lighthouse at ``host:port`` has heard from within its heartbeat
    timeout, from its status page; None when it does not answer."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{host}:{port}/status", timeout=2) as reply:
            page = reply.read().decode("utf-8", "replace")
    except OSError:
        return None
    return live_groups(page, HEARTBEAT_TIMEOUT_MS / 1000)


def replica_name(group: int, ranks_per_group: int) -> str:
    """The replica id fabriclite gives torchft for replica group ``group`` of ``ranks_per_group`` ranks:
    ``group_<i>`` for one rank, ``r<R>_group_<i>`` for R > 1 (torchft reads the trailing digits as the group's
    number; the lighthouse's status page and every quorum then say how many ranks each group runs)."""
    return f"group_{group}" if ranks_per_group == 1 else f"r{ranks_per_group}_group_{group}"


def group_of(replica_id: str) -> Optional[int]:
    """The group (node rank) of a replica id fabriclite gives torchft (:func:`replica_name`, torchft adds
    ``:<uuid>``); None for another name (an external lighthouse may serve other jobs' groups too)."""
    parsed = _parse_replica_id(replica_id)
    return parsed[0] if parsed else None


def ranks_of(replica_id: str) -> Optional[int]:
    """The ranks per group a replica id of :func:`replica_name` names (1 without the ``r<R>_`` prefix); None for
    another name."""
    parsed = _parse_replica_id(replica_id)
    return parsed[1] if parsed else None


def _parse_replica_id(replica_id: str) -> Optional[Tuple[int, int]]:
    """(group, ranks per group) of a :func:`replica_name` id (torchft's ``:<uuid>`` after it or not), or None."""
    match = re.fullmatch(r"(?:r(\d+)_)?group_(\d+)(:.*)?", replica_id)
    return (int(match.group(2)), int(match.group(1) or 1)) if match else None


def ranks_mismatch(replica_ids: List[str], group: int, ranks_per_group: int) -> Optional[str]:
    """The error when a replica id among ``replica_ids`` names another number of ranks per group than this
    group's ``ranks_per_group`` (a node that came back with fewer or more devices), naming both numbers; None when
    they agree."""
    for replica_id in replica_ids:
        other, ranks = group_of(replica_id), ranks_of(replica_id)
        if ranks is not None and other is not None and ranks != ranks_per_group:
            return (f"fabriclite: replica group {group} runs {ranks_per_group} rank(s) per group (--devices "
                    f"{ranks_per_group}) but replica group {other} runs {ranks} (--devices {ranks}): every node of a "
                    f"--fault-tolerant job runs the same number of ranks per replica group (rank r of each group "
                    f"exchanges gradients and heals with rank r of the others). Start this node with --devices "
                    f"{ranks}, or restart the job with one --devices on every node.")
    return None


def live_groups(page: str, heartbeat_timeout_s: float) -> List[str]:
    """The replica ids whose last heartbeat, as torchft's lighthouse status page lists it ("<id>: seen 1.35s ago",
    a Rust Duration), is younger than ``heartbeat_timeout_s``."""
    units = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
    alive = []
    for replica, value, unit in re.findall(r"([^\s<>]+): seen ([0-9.]+)(ns|µs|us|ms|s) ago", page):
        if float(value) * units[unit] < heartbeat_timeout_s:
            alive.append(replica)
    return alive


def wait_reachable(host: str, port: int, timeout: timedelta, alive: Callable[[], bool] = lambda: True) -> None:
    """Return once something accepts connections at ``host:port``; LighthouseError naming the address after
    ``timeout`` (or as soon as ``alive()`` is false)."""
    try:
        rendezvous.wait_listening(host, port, timeout, alive)
    except rendezvous.RendezvousError as err:
        raise LighthouseError(f"fabriclite: could not reach the lighthouse at {host}:{port} {err}; start node 0 "
                              f"(it hosts the lighthouse), or check --lighthouse / --main-address and that port "
                              f"{port} is open.") from None
