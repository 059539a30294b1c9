"""Every key of the job's store, in one place: its name, who writes it, who reads it, and when it goes.

The store is node 0's supervisor's TCPStore (``rendezvous.host_store``); under torchrun or srun without a
supervisor, rank 0 hosts it (or torchrun's agents' store is joined). Its layout:

- ``fabriclite/`` (:data:`PREFIX`): every fabriclite key below, except the restart agreement's; a restart round
  ``n`` > 0 sees the store under ``round<n>`` first (:func:`round_part`), so no rank or supervisor of an old round
  shares a key with a new one.
- ``pg/`` (:data:`PROCESS_GROUP_PREFIX`, beside ``fabriclite/`` in a round's part): torch's process group.
- ``restarts/<round>/`` (:func:`restart_report`, :func:`restart_decision`): on the store itself, outside rounds.
- ``fabriclite/torchelastic/`` (:data:`TORCHELASTIC`): the ranks of one torchrun start meet there, in the agents'
  store that outlives every start.

=====================================  ===================================  ==================================
key (under ``fabriclite/``)            written by / read by                 goes
=====================================  ===================================  ==================================
``failure``                            the first failing node's supervisor   with the store (the job's end)
                                       (a root cause replaces a secondary
                                       one) / every supervisor (polled),
                                       ranks in waits without a deadline
``arrived/<rank>``, ``arrived/count``  each rank at launch / every rank      with the round's part
                                       (until all arrived)
``beat/<node>``                        node N's supervisor (a counter,       with the store
                                       every REMOTE_POLL_S) / node 0's as
                                       it leaves
``ended/<node>``                       node N's supervisor as it leaves /    with the store
                                       node 0's
``straggle/<window>/<node>``           node N's supervisor once per window   with the round's part
                                       / node 0's
``progress/<rank>``                    each rank's collective-watch thread   with the round's part
                                       (every second) / a rank whose
                                       collective failed
``collectives/rank_zero_first/<n>``    rank 0 (local rank 0: ``/node<N>``)   with the round's part
                                       after the block / the other ranks
=====================================  ===================================  ==================================

Keys outside ``fabriclite/``: ``restarts/<round>/node/<node>`` (each supervisor after a failed round: "1" can go on,
"0" cannot) and ``restarts/<round>/decision`` (node 0's supervisor: ``{"delay": seconds or null}``), read by
node 0's and the other supervisors; ``fabriclite/torchelastic/current``, ``.../<start>/member/<rank>`` and
``.../<start>/go`` (see ``meeting.launch_namespace``). None is deleted today: a round's keys are left behind with
its part of the store, and the store ends with node 0's supervisor.
"""
from __future__ import annotations

from typing import Optional

#: the prefix of every fabriclite key in the job's store (the process group has its own, PROCESS_GROUP_PREFIX)
PREFIX = "fabriclite/"
#: the prefix of torch's process group keys in a round's part of the store
PROCESS_GROUP_PREFIX = "pg/"
#: the job's failure flag (under PREFIX): the first failure a supervisor published, as JSON
FAILURE = "failure"
#: where the ranks check in at launch (under PREFIX): ``arrived/<rank>`` and ``arrived/count``
ARRIVED = "arrived"
#: where the ranks of one torchrun start meet, in the agents' store (not under a round's part)
TORCHELASTIC = "fabriclite/torchelastic/"


def round_part(round_number: int) -> str:
    """The prefix of restart round ``round_number``'s part of the store ("" for round 0: the store itself)."""
    return "" if round_number == 0 else f"round{round_number}"


def beat(node: int) -> str:
    """Node ``node``'s supervisor's heartbeat counter."""
    return f"beat/{node}"


def ended(node: int) -> str:
    """Set once node ``node``'s supervisor is leaving."""
    return f"ended/{node}"


def restart_report(round_number: int, node: int) -> str:
    """Whether node ``node`` can go on after failed round ``round_number`` (on the store itself, not under PREFIX)."""
    return f"restarts/{round_number}/node/{node}"


def restart_decision(round_number: int) -> str:
    """Node 0's decision after failed round ``round_number`` (on the store itself, not under PREFIX)."""
    return f"restarts/{round_number}/decision"


def straggler_report(window: int, node: int) -> str:
    """Node ``node``'s ranks' busy seconds per step over straggler window ``window``."""
    return f"straggle/{window}/{node}"


def collective_progress(rank: int) -> str:
    """Rank ``rank``'s collective counts, as its collective-watch thread last published them."""
    return f"progress/{rank}"


def rank_zero_first(call: int, node: Optional[int] = None) -> str:
    """The outcome of the ``call``-th ``rank_zero_first`` block (``node``: the per-node form, ``local=True``)."""
    key = f"collectives/rank_zero_first/{call}"
    return key if node is None else f"{key}/node{node}"
