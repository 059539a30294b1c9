"""Many simulated nodes on a few threads: each node's work is a chain of short tasks (a task makes a few store
requests and returns the delay until the chain's next task, or None when the chain ends), run by a small pool of
threads from one heap of due times. Waiting costs nothing: a waiting chain is an entry in the heap, not a thread.
How late tasks start (the loop's lag) is kept, so the results can say whether the model kept up."""
from __future__ import annotations

import heapq
import itertools
import threading
import time
import traceback
from typing import Callable, List, Optional, Tuple

Task = Callable[[], Optional[float]]


class Loop:
    def __init__(self, threads: int = 4) -> None:
        self._heap: List[Tuple[float, int, Task]] = []
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._stopping = False
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"loop-{i}") for i in range(threads)]
        self.errors: List[str] = []
        self.max_lag_s = 0.0
        self._lags: List[float] = []
        for t in self._threads:
            t.start()

    def at(self, when: float, task: Task) -> None:
        """Run ``task`` at monotonic time ``when`` (then again after the delay it returns, until None)."""
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._seq), task))
            self._cond.notify()

    def soon(self, task: Task, delay: float = 0.0) -> None:
        self.at(time.monotonic() + delay, task)

    def lag(self, reset: bool = True) -> Tuple[float, float]:
        """(median, max) seconds by which tasks started late since the last reset."""
        with self._cond:
            lags = sorted(self._lags)
            if reset:
                self._lags = []
                worst, self.max_lag_s = self.max_lag_s, 0.0
            else:
                worst = self.max_lag_s
        return (lags[len(lags) // 2] if lags else 0.0), worst

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    self._cond.wait(min(0.05, self._heap[0][0] - now) if self._heap else 0.05)
                if self._stopping:
                    return
                when, _, task = heapq.heappop(self._heap)
                late = time.monotonic() - when
                if len(self._lags) < 200000:
                    self._lags.append(late)
                self.max_lag_s = max(self.max_lag_s, late)
            try:
                delay = task()
            except Exception:  # a chain that raised ends; the phase reports it
                self.errors.append(traceback.format_exc(limit=8))
                continue
            if delay is not None:
                self.at(time.monotonic() + delay, task)


class Done:
    """Per-node completion times of one phase: ``mark(node)``; ``wait(expected, deadline)``."""

    def __init__(self) -> None:
        self.times: dict = {}
        self._cond = threading.Condition()

    def mark(self, key: object, when: Optional[float] = None) -> None:
        with self._cond:
            self.times.setdefault(key, time.monotonic() if when is None else when)
            self._cond.notify_all()

    def wait(self, expected: int, deadline: float) -> bool:
        with self._cond:
            while len(self.times) < expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.2))
            return True
