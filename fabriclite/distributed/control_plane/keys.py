"""Every key of the job's store, in one place: its name, who writes it, who reads it, and when it goes.

The store is node 0's supervisor's TCPStore (``rendezvous.host_store``); under torchrun or srun without a
supervisor, rank 0 hosts it (or torchrun's agents' store is joined). Its layout:

- ``fabriclite/`` (:data:`PREFIX`): every fabriclite key below, except the restart agreement's; a restart round
  ``n`` > 0 sees the store under ``round<n>`` first (:func:`round_part`), so no rank or supervisor of an old round
  shares a key with a new one.
- ``pg/`` (:data:`PROCESS_GROUP_PREFIX`, beside ``fabriclite/`` in a round's part): torch's process group.
- ``restarts/<round>/`` (:func:`restart_reports`, :func:`restart_decision`): on the store itself, outside rounds.
- ``fabriclite/torchelastic/`` (:data:`TORCHELASTIC`): the ranks of one torchrun start meet there, in the agents'
  store that outlives every start.

Nothing grows with the number of steps: every key is written once per round or overwritten in place, and the
ones that are done with are deleted. Per round (N nodes, W ranks): the counters (N pulses), N host names, the failure
record, W progress records, 2 N straggler slots; the restart agreement adds 2 keys per failed round, and node 0 deletes the previous
round's when it decides.

=====================================  ===================================  ==================================
key (under ``fabriclite/``)            written by / read by                 goes
=====================================  ===================================  ==================================
``failure``                            the first failing node's supervisor  with the round's part
                                       (a root cause replaces a secondary
                                       one) / every supervisor and waiting
                                       rank, once the flag is up
``pulse/<node>``                       node N's supervisor, +1 every        with the round's part
                                       ``liveness.PULSE_S`` (its answer
                                       carries the failure flag), +FAILED
                                       with the failure, +LEFT as it leaves
                                       / node 0's, all at once (check +
                                       multi_get): a node whose count stops
                                       moving before LEFT is lost
``host/<node>``                        node N's supervisor at the round's   with the round's part
                                       start / node 0's, when it names a
                                       node that stopped answering
``slow/<node>``                        node N's supervisor, once, when its  with the round's part
                                       heartbeats take seconds (then +SLOW
                                       on its pulse) / node 0's, once
``ended``                              each supervisor as it leaves, +1 /   with the round's part
                                       node 0's
``arrived/count``                      each rank at launch, +1; +FAILED     with the round's part
                                       with a failure / every rank until
                                       all arrived
``arrived/<rank>``                     each rank at launch / a rank whose   by that rank once all arrived
                                       wait timed out (who is missing)
``straggle/<node>/<window % 2>``       node N's supervisor once per window  overwritten two windows later
                                       / node 0's, every node's at once
                                       (check + multi_get)
``progress/<rank>``                    each rank's collective-watch thread  overwritten in place
                                       (``publish_interval``) / a rank
                                       whose collective failed
``collectives/rank_zero_first/<n>``    rank 0 (local rank 0: ``/node<N>``)  by the last waiting rank to read
(and ``.../read``, a counter)          after the block / the other ranks    it
=====================================  ===================================  ==================================

Keys outside ``fabriclite/``: ``restarts/<round>/reports`` (a counter: each supervisor after a failed round adds 1,
plus UNABLE when it cannot go on) and ``restarts/<round>/decision`` (node 0's supervisor: ``{"delay": seconds or
null}``), read by node 0's and the other supervisors, deleted by node 0 when it decides the next failed round;
``fabriclite/torchelastic/current``, ``.../<start>/member/<rank>`` and ``.../<start>/go`` (see
``meeting.launch_namespace``; torchrun's store, one set per start of the ranks).
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


#: the prefix of the supervisors' pulse counters, one per node (under PREFIX, in a round's part): see liveness.pulse
PULSE = "pulse"
#: how many supervisors have left (under PREFIX, in a round's part): see liveness.leave
ENDED = "ended"
#: added to every counter of ``flagged`` when a failure is published: a counter at or above it says "failed"
FAILED = 1 << 40


#: added once to a node's pulse counter by a node that finds its own link slow (its report under ``slow_link``)
SLOW = 1 << 30
#: added once to a node's pulse counter by its supervisor as it leaves: its pulse stops, and it is not lost
LEFT = 1 << 35


def slow_link(node: int) -> str:
    """Node ``node``'s report of its slow link (JSON), written once per round before it flags its pulse with SLOW."""
    return f"slow/{node}"


def pulse(node: int) -> str:
    """Node ``node``'s pulse counter: its supervisor adds 1 every ``liveness.PULSE_S`` (node 0 reads them all)."""
    return f"{PULSE}/{node}"


def node_host(node: int) -> str:
    """Node ``node``'s host name and address, as its supervisor announced them at the round's start."""
    return f"host/{node}"


def flagged(num_nodes: int) -> list:
    """The counters that carry the failure flag (under PREFIX): every node's pulse and the ranks' check-in count,
    so whoever polls one of them sees a failure for free."""
    return [f"{ARRIVED}/count", *(pulse(node) for node in range(num_nodes))]
#: added to the restart reports' counter by a node that cannot go on (its low bits count the reports)
UNABLE = 1 << 20


def restart_reports(round_number: int) -> str:
    """The count of nodes that reported after failed round ``round_number`` (+UNABLE for each that cannot go on;
    on the store itself, not under PREFIX)."""
    return f"restarts/{round_number}/reports"


def restart_decision(round_number: int) -> str:
    """Node 0's decision after failed round ``round_number`` (on the store itself, not under PREFIX)."""
    return f"restarts/{round_number}/decision"


def straggler_report(window: int, node: int) -> str:
    """Node ``node``'s slot for straggler window ``window``: two per node, used in turn (window parity), so that a
    node one window ahead does not overwrite the window node 0 is reading."""
    return f"straggle/{node}/{window % 2}"


def collective_progress(rank: int) -> str:
    """Rank ``rank``'s collective counts, as its collective-watch thread last published them."""
    return f"progress/{rank}"


def rank_zero_first(call: int, node: Optional[int] = None) -> str:
    """The outcome of the ``call``-th ``rank_zero_first`` block (``node``: the per-node form, ``local=True``)."""
    key = f"collectives/rank_zero_first/{call}"
    return key if node is None else f"{key}/node{node}"


def readers(key: str) -> str:
    """The counter of the waiting ranks that have read ``key`` (the last one deletes both)."""
    return f"{key}/read"
