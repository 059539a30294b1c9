"""The job's store as a supervisor reaches it: every request has a deadline, whatever TCP does.

A torch ``TCPStore`` client blocks in the kernel until its peer answers; after a partition that is TCP's
retransmission limit (about 15 minutes), whatever timeout the store was given, and the blocked thread hears no
signal. :class:`StoreClient` runs each request on a thread of its own (one per connection, requests in order) and the
caller waits at most ``deadline_s`` for the answer, in slices, so it also stops waiting at once when
``interrupted()`` turns true (a supervisor that got SIGINT). A request that missed its deadline is abandoned, not
cancelled: it stays on the thread until TCP gives up or the link returns; meanwhile every new request fails at once,
naming the store's address and since when it has not answered. An answer that comes after all (a short flap) makes
the store reachable again.

``submit`` runs a whole exchange (a function of the store, e.g. ``liveness.pulse``) on that thread without waiting:
a supervisor's loop keeps polling its ranks and answering signals while its heartbeat is in flight.

Lowest floor: imports nothing of fabriclite. The security handshake of a job secret builds on this seam (the
connection the thread owns).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, List, Optional

#: how often a waiting caller looks at ``interrupted()`` (seconds), and how much longer it then waits for an answer
#: (a healthy store answers in milliseconds, a loaded machine's in tens of them: the word "stopped on SIGINT" still
#: reaches the other nodes; a silent one costs at most this before the signal is answered)
SLICE_S = 0.05
INTERRUPTED_GRACE_S = 0.5


class StoreUnreachable(RuntimeError):
    """The job's store did not answer within the deadline. ``where`` is its ``HOST:PORT``, ``since`` the wall time of
    the oldest request still unanswered."""

    def __init__(self, where: str, since: float, what: str) -> None:
        self.where, self.since = where, since
        super().__init__(f"the job's store at {where} has not answered since {clock(since)} "
                         f"({time.time() - since:.1f} s; {what})")


class RequestAbandoned(RuntimeError):
    """The caller stopped waiting for the store's answer because ``interrupted()`` turned true (a signal)."""


class Request:
    """One exchange with the store, run on the client's thread: ``done`` is set once ``result`` or ``error`` is."""

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None
        #: wall times when the thread started and finished it (None until then)
        self.started: Optional[float] = None
        self.finished: Optional[float] = None
        self.submitted = time.time()

    def outcome(self) -> Any:
        """The result, or the error raised again (only once ``done``)."""
        if self.error is not None:
            raise self.error
        return self.result


class _Connection:
    """The thread that owns one store connection, shared by every view of it."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.requests: "queue.Queue[Request]" = queue.Queue()
        self.current: Optional[Request] = None
        #: the last request a caller stopped waiting for at its deadline
        self.abandoned: Optional[Request] = None
        self.thread = threading.Thread(target=self._run, name=f"fabriclite-store-{where}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            request = self.requests.get()
            request.started = time.time()
            self.current = request
            try:
                request.result = request.fn(*request.args)
            except BaseException as err:  # handed to the caller
                request.error = err
            request.finished = time.time()
            self.current = None
            request.done.set()

    def stuck_since(self, deadline_s: float) -> Optional[float]:
        """When the request now on the thread was started, if a caller abandoned it or it is more than
        ``deadline_s`` old; else None."""
        current = self.current
        started = current.started if current is not None else None
        if started is not None and (current is self.abandoned or time.time() - started > deadline_s):
            return started
        return None


class StoreClient:
    """``store`` (a ``torch.distributed.Store``: TCPStore, or a PrefixStore over one) with a deadline on each request.

    Offers the store calls fabriclite makes (``get``, ``set``, ``add``, ``check``, ``multi_get``, ``multi_set``,
    ``delete_key``, ``compare_set``, ``num_keys``): each returns what the store returns, raises what it raises, or
    raises :class:`StoreUnreachable` (a ``RuntimeError``, as a store that is gone) after ``deadline_s``, or at once
    while an earlier request is past its deadline; :class:`RequestAbandoned` when ``interrupted()`` turned true."""

    def __init__(self, store: Any, where: str, deadline_s: float,
                 interrupted: Callable[[], bool] = lambda: False, _connection: Optional[_Connection] = None) -> None:
        if deadline_s <= 0:
            raise ValueError(f"deadline_s={deadline_s!r}: a store request's deadline must be positive (seconds).")
        self.store, self.where, self.deadline_s, self.interrupted = store, where, deadline_s, interrupted
        self._connection = _connection or _Connection(where)

    def view(self, store: Any) -> "StoreClient":
        """The same connection seen as ``store`` (a PrefixStore over this client's store): the same thread, deadline
        and health."""
        return StoreClient(store, self.where, self.deadline_s, self.interrupted, self._connection)

    # ------------------------------------------------------------------ health
    @property
    def unanswered_since(self) -> Optional[float]:
        """Wall time since when the store has not answered a request that is past its deadline, or None."""
        return self._connection.stuck_since(self.deadline_s)

    # ------------------------------------------------------------------ requests
    def submit(self, fn: Callable[..., Any], *args: Any) -> Request:
        """Run ``fn(store, *args)`` on the connection's thread, after the requests before it; returns at once."""
        request = Request(fn, (self.store, *args))
        self._connection.requests.put(request)
        return request

    def wait(self, request: Request, what: str) -> Any:
        """``request``'s outcome, waiting at most ``deadline_s`` from now (StoreUnreachable naming ``what`` after
        that), and at most INTERRUPTED_GRACE_S once ``interrupted()`` (then RequestAbandoned)."""
        end, interrupted = time.monotonic() + self.deadline_s, False
        while not request.done.wait(min(SLICE_S, max(0.0, end - time.monotonic()))):
            if not interrupted and self.interrupted():  # a healthy store still answers within the grace
                interrupted, end = True, min(end, time.monotonic() + INTERRUPTED_GRACE_S)
            if time.monotonic() < end:
                continue
            self._connection.abandoned = request  # the next requests fail at once while it is unanswered
            if interrupted:
                raise RequestAbandoned(f"stopped waiting for the job's store at {self.where} ({what}): interrupted")
            raise StoreUnreachable(self.where, request.started or request.submitted, what)
        return request.outcome()

    def _call(self, name: str, *args: Any) -> Any:
        since = self.unanswered_since
        if since is not None:
            raise StoreUnreachable(self.where, since, f"{name} not sent: an earlier request is still unanswered")
        return self.wait(self.submit(lambda store, *a: getattr(store, name)(*a), *args), name)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def check(self, keys: List[str]) -> bool:
        return self._call("check", keys)

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return self._call("multi_get", keys)

    def multi_set(self, keys: List[str], values: List[Any]) -> None:
        self._call("multi_set", keys, values)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def num_keys(self) -> int:
        return self._call("num_keys")


def clock(wall: float) -> str:
    """``14:03:07.2 UTC`` for a wall time, as the supervisors' messages give times."""
    return time.strftime("%H:%M:%S", time.gmtime(wall)) + f".{int(wall * 10) % 10} UTC"
