"""Straggler reports across nodes: each node's supervisor publishes its ranks' busy seconds per step over a window;
node 0's collects every node's at once (one check and one multi_get of the N slots) once all have reported. Each
node has two slots, used in turn by window parity, overwritten in place: the keys do not grow with the windows.
Takes the job's store seen under ``keys.PREFIX`` (the round's part)."""
from __future__ import annotations

import json
from typing import Any, Dict, List

from fabriclite.distributed.control_plane import keys


def publish(store: Any, window: int, node_rank: int, busy: Dict[int, float]) -> bool:
    """Publish node ``node_rank``'s ``busy`` (global rank -> busy seconds per step) for ``window``; False when the
    store is gone."""
    try:
        store.set(keys.straggler_report(window, node_rank), json.dumps({"window": window, "busy": busy}))
        return True
    except RuntimeError:
        return False


class Collector:
    """Node 0's side: :meth:`collect` at the end of each of its windows gives the windows every node has now
    reported, merged (global rank -> busy seconds per step). A window some node has not reported yet is tried
    again at the next one; after that its slots are being reused and it is dropped (a node that far behind is
    judged at its own pace: later windows)."""

    def __init__(self, num_nodes: int) -> None:
        self.num_nodes = num_nodes
        self._pending: List[int] = []

    def collect(self, store: Any, window: int) -> List[Dict[int, float]]:
        """Two requests per window tried (check, then multi_get); [] when the store is gone."""
        if window not in self._pending:
            self._pending.append(window)
        done: List[Dict[int, float]] = []
        for number in list(self._pending):
            slots = [keys.straggler_report(number, node) for node in range(self.num_nodes)]
            try:
                reports = [json.loads(raw) for raw in store.multi_get(slots)] if store.check(slots) else []
            except RuntimeError:
                return done
            windows = {r["window"] for r in reports}
            if reports and windows == {number}:
                merged: Dict[int, float] = {}
                for r in reports:
                    merged.update({int(k): v for k, v in r["busy"].items()})
                done.append(merged)
                self._pending.remove(number)
            elif number < window or any(w > number for w in windows):
                self._pending.remove(number)  # its slots are taken by a later window now
        return done
