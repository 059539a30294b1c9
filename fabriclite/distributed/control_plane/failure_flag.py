"""The job's failure flag: the first failure a supervisor publishes in the job's store, for every node and rank.

The record goes under ``failure``; then the flag goes up in every counter that supervisors and ranks poll anyway
(``keys.flagged``: every supervisor's pulse, the ranks' check-in count), so that they see it in the answer to a
request they make regardless, and no one polls the flag on its own in steady state. Every function takes the
job's store seen under ``keys.PREFIX`` (``meeting.job_view``).
"""
from __future__ import annotations

import json
import time
from typing import Any, Dict, Optional

from fabriclite.distributed.control_plane import keys, polling

#: the failure flag's key (under keys.PREFIX)
FAILURE_KEY = keys.FAILURE
#: how often a wait on something else reads the failure record besides (seconds)
FAILURE_CHECK_S = 1.0


class JobFailedElsewhere(RuntimeError):
    """Raised in a rank that waits without a deadline when the job's supervisor reports a failure
    (on this node or another); the message is the supervisor's description of that failure."""


def read_failure(store: Any) -> Optional[Dict[str, Any]]:
    """The failure a supervisor published (keys: node, rank, message, timestamp, secondary), or None.

    A store that cannot be reached counts as a failure (its host, node 0's supervisor, is gone)."""
    try:
        if not store.check([FAILURE_KEY]):
            return None
        return json.loads(store.get(FAILURE_KEY))
    except RuntimeError as err:
        return store_gone(err)


def store_gone(err: BaseException) -> Dict[str, Any]:
    """The failure record of a store that answered a request with ``err``: its host, node 0's supervisor, is gone."""
    return {"node": None, "rank": None, "timestamp": time.time(), "secondary": False,
            "message": f"the job's rendezvous store is gone (its supervisor ended?): {err}"}


def publish_failure(store: Any, record: Dict[str, Any], num_nodes: int = 1) -> None:
    """Publish ``record`` as the job's failure unless one is there already; a root cause
    (``secondary`` False) replaces a secondary one; the flag goes up in the pulse of each of ``num_nodes`` nodes.
    Never raises."""
    try:
        old = read_failure(store)
        if old is None or (old.get("secondary") and not record.get("secondary")):
            store.set(FAILURE_KEY, json.dumps(record))
        if old is None:  # the record first, then the flag: whoever sees the flag finds the record
            for counter in keys.flagged(num_nodes):
                store.add(counter, keys.FAILED)
    except RuntimeError:
        pass


def flagged(count: int) -> bool:
    """Whether ``count``, read from one of ``keys.FLAGGED``, carries the failure flag."""
    return count >= keys.FAILED


def flagged_failure(store: Any) -> Dict[str, Any]:
    """The published record, for a poller that saw the flag in a counter (a placeholder if it is unreadable)."""
    return read_failure(store) or {"node": None, "rank": None, "timestamp": time.time(), "secondary": False,
                                   "message": "a failure was flagged but its record could not be read"}


def failed(store: Any) -> bool:
    """Whether a failure is published (a store that cannot be reached raises RuntimeError)."""
    return bool(store.check([FAILURE_KEY]))


def describe_failure(record: Dict[str, Any]) -> str:
    """"node 1: rank 3 (local rank 1, node 1) raised ValueError: boom" for a published record (a message that starts
    with the nodes it is about, "node 2 (host) stopped answering ...", is not prefixed)."""
    node = record.get("node")
    named = str(record["message"]).startswith(("node ", "nodes "))
    where = f"node {node}: " if node is not None and not named else ""
    return f"{where}{record['message']}"


def failure_line(record: Dict[str, Any]) -> str:
    """"the job failed on node 1: rank 3 ... raised ValueError: boom"; "the job failed: node 2 (host) stopped
    answering ..." (a record about nodes, or about the store, names them itself)."""
    where = describe_failure(record)
    on_node = record.get("node") is not None and where.startswith(f"node {record['node']}: ")
    return f"the job failed on {where}" if on_node else f"the job failed: {where}"


def raise_if_failed(store: Any, what: str) -> None:
    """Raise JobFailedElsewhere if a supervisor has reported a failure of the job."""
    record = read_failure(store)
    if record is not None:
        raise JobFailedElsewhere(f"fabriclite: stopped {what}: the job failed on {describe_failure(record)}")


def wait_for_key(store: Any, key: str, what: str, poll_s: float = 0.05) -> None:
    """Wait, without a deadline, until ``key`` is set in ``store``.

    For waits that are not faults however long they take (rank 0 first, a checkpoint being
    written): instead of a timeout, it raises JobFailedElsewhere (naming the failed node and rank)
    as soon as the job's supervisor reports a failure. ``what`` says what is awaited, for the error.
    """
    backoff, checked = polling.Backoff(0.001, poll_s), None
    while not store.check([key]):
        time.sleep(backoff.next())
        checked = check_now(store, what, checked, backoff.current >= poll_s)


def check_now(store: Any, what: str, checked: Optional[float], ready: bool) -> Optional[float]:
    """For a wait on something else: read the failure record (JobFailedElsewhere if there is one) once ``ready``
    (its backoff reached the ceiling), then at most every FAILURE_CHECK_S; when it last did (``checked``)."""
    if not ready or (checked is not None and time.monotonic() - checked < FAILURE_CHECK_S):
        return checked
    raise_if_failed(store, what)
    return time.monotonic()
