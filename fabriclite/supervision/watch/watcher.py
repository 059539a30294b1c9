"""The one shape of a watcher, and what the supervisor's loop hands it.

A node's supervisor reads its ranks' progress records at most every ``progress_records.CHECK_EVERY_S``; each
time, its loop (supervision/agent/supervisor.py, ``_observe``) hands the same :class:`RoundView` to every watcher
in turn, in a fixed order (hangs, ranks up, stragglers, step rates), and handles the events they return the same
way: an event is written to the events record (with its line printed on node 0's stderr where it has one), and one
that ends the round (a hang) makes the supervisor take stacks, record the failure and stop the round. A watcher
never prints, writes the record or stops ranks itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Tuple


@dataclass
class RoundView:
    """One read of this node's round: ``records`` (global rank -> its progress record, None before the rank
    joined) and ``workers`` (local rank -> (pid, still running)) of the ranks still running."""

    records: Dict[int, Optional[dict]]
    workers: Dict[int, Tuple[int, bool]]


@dataclass
class Event:
    """What a watcher saw: ``kind`` and ``fields`` as the events record writes them (supervision/watch/events.py),
    ``line`` for node 0's stderr ("" for none); ``ends_round``: the round must stop (a hang: the supervisor records
    it with the stacks it takes)."""

    kind: str
    fields: Dict[str, Any] = field(default_factory=dict)
    line: str = ""
    ends_round: bool = False


class Watcher(Protocol):
    """What the supervisor's loop drives: ``start_round`` before a round's ranks start, ``observe`` at each read."""

    def start_round(self, number: int) -> None:
        """Round ``number`` (0: the first start) is about to start: forget what the last round showed."""

    def observe(self, view: RoundView) -> List[Event]:
        """What this read shows (often nothing)."""
