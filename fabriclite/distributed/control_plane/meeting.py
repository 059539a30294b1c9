"""Meeting: the parts of the job's store that a round's ranks and supervisors share, the ranks' check-in at launch,
and where the ranks of one torchrun start meet. Pure store protocol: every function takes a store.
"""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any, List

from torch.distributed import PrefixStore, Store

from fabriclite.distributed.control_plane import failure_flag, keys, polling
from fabriclite.distributed.rendezvous import RendezvousError


def job_view(store: Store, round_number: int = 0) -> PrefixStore:
    """The part of the job's store where round ``round_number``'s fabriclite keys live (see keys.py)."""
    return prefixed(round_store(store, round_number), keys.PREFIX)


def prefixed(store: Store, prefix: str) -> PrefixStore:
    """``store`` seen under ``prefix`` (fabriclite's keys live under keys.PREFIX)."""
    return PrefixStore(prefix, store)


def round_store(store: Store, round_number: int) -> Store:
    """The part of the job's store that restart round ``round_number`` uses (round 0: the store itself, so
    jobs without restarts keep their keys): ranks and supervisors of different rounds never share a key."""
    return store if round_number == 0 else PrefixStore(keys.round_part(round_number), store)


class Arrival:
    """One rank's check-in under ``key``: :meth:`arrive`, then :meth:`poll` until True (``delay()`` seconds apart),
    then :meth:`leave`. One request per poll (the count, which also carries the failure flag); the poll interval's
    ceiling grows with ``world_size`` (polling.ceiling) so that a large job does not flood the store."""

    def __init__(self, store: Store, key: str, rank: int, world_size: int) -> None:
        self.store, self.key, self.rank, self.world_size = store, key, rank, world_size
        self.arrived = False
        self.count = 0
        self._backoff = polling.Backoff(0.001, polling.ceiling(world_size, 0.1))

    def arrive(self) -> None:
        self.store.set(f"{self.key}/{self.rank}", "1")
        self.count = self.store.add(f"{self.key}/count", 1)
        self.arrived = True

    def poll(self) -> bool:
        """Whether every rank has arrived; JobFailedElsewhere once a supervisor has published a failure."""
        if self.count < self.world_size:
            self.count = self.store.add(f"{self.key}/count", 0)
        if failure_flag.flagged(self.count):
            record = failure_flag.flagged_failure(self.store)
            raise failure_flag.JobFailedElsewhere(f"fabriclite: stopped waiting for the other ranks to join: the job "
                                                  f"failed on {failure_flag.describe_failure(record)}")
        return self.count >= self.world_size

    def delay(self) -> float:
        return self._backoff.next()

    def leave(self) -> None:
        """Every rank has arrived: this rank's own key (kept to name the missing ranks) is done with."""
        self.store.delete_key(f"{self.key}/{self.rank}")


def wait_for_ranks(store: Store, key: str, rank: int, world_size: int, timeout: timedelta,
                   where: str = "") -> None:
    """Every rank checks in under ``key``; returns when all ``world_size`` have, else raises a
    RendezvousError listing the ranks that never arrived (within ``timeout``), or JobFailedElsewhere
    as soon as a supervisor reports a failure. ``where`` ("address:port") goes into the error."""
    arrival = Arrival(store, key, rank, world_size)
    arrival.arrive()
    deadline = time.monotonic() + timeout.total_seconds()
    while not arrival.poll():
        if time.monotonic() > deadline:
            missing = missing_ranks(store, key, world_size)
            raise RendezvousError(
                f"fabriclite: ranks {missing} of {world_size} never joined the rendezvous"
                f"{' at ' + where if where else ''} within {timeout.total_seconds():.0f} s "
                f"(rank {rank} waited). Were all nodes started, with the same --num-nodes/--devices and main "
                f"address/port?"
            )
        time.sleep(arrival.delay())
    arrival.leave()


def missing_ranks(store: Store, key: str, world_size: int) -> List[int]:
    """The ranks of ``range(world_size)`` that have not checked in under ``key``."""
    return [r for r in range(world_size) if not store.check([f"{key}/{r}"])]


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
        store.set(f"{keys.TORCHELASTIC}current", nonce)
    deadline = time.monotonic() + timeout.total_seconds()
    name, delay = None, 0.001
    while True:
        if time.monotonic() > deadline:
            waited = f"within {timeout.total_seconds():.0f} s (rank {rank} of {world_size} waited)"
            if name is None or store.check([f"{keys.TORCHELASTIC}{name}/go"]):
                raise RendezvousError(f"fabriclite: rank 0 of this start never named its part of torchrun's store "
                                      f"{waited}; the part named there, if any, is an earlier start's. Did rank 0's "
                                      "worker start (its agent's log)?")
            missing = [r for r in range(world_size) if not store.check([f"{keys.TORCHELASTIC}{name}/member/{r}"])]
            raise RendezvousError(f"fabriclite: ranks {missing} never met in torchrun's store {waited}.")
        if store.check([f"{keys.TORCHELASTIC}current"]):
            current = store.get(f"{keys.TORCHELASTIC}current").decode()
            if current != name:
                name = current
                store.set(f"{keys.TORCHELASTIC}{name}/member/{rank}", nonce)
            base = f"{keys.TORCHELASTIC}{name}/"
            if rank == 0 and not store.check([base + "go"]) and \
                    store.check([f"{base}member/{r}" for r in range(world_size)]):
                members = [store.get(f"{base}member/{r}").decode() for r in range(world_size)]
                store.set(base + "go", json.dumps(members))
            if store.check([base + "go"]):
                members = json.loads(store.get(base + "go"))
                if rank < len(members) and members[rank] == nonce:
                    return f"{keys.TORCHELASTIC}{name}/"
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
