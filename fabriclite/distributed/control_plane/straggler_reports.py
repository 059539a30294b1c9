"""Straggler reports across nodes: each node's supervisor publishes its ranks' busy seconds per step over a window;
node 0's collects every node's once all have reported. Takes the job's store seen under ``keys.PREFIX`` (the
round's part)."""
from __future__ import annotations

import json
from typing import Any, Dict, Optional

from fabriclite.distributed.control_plane import keys


def publish(store: Any, window: int, node_rank: int, busy: Dict[int, float]) -> bool:
    """Publish node ``node_rank``'s ``busy`` (global rank -> busy seconds per step) for ``window``; False when the
    store is gone."""
    try:
        store.set(keys.straggler_report(window, node_rank), json.dumps(busy))
        return True
    except RuntimeError:
        return False


def collect(store: Any, window: int, num_nodes: int) -> Optional[Dict[int, float]]:
    """Every node's report for ``window``, merged (global rank -> busy seconds per step); None while a node has
    not reported yet (it is judged at its own pace: a later window) or when the store is gone."""
    everyone: Dict[int, float] = {}
    for node in range(num_nodes):
        key = keys.straggler_report(window, node)
        try:
            if not store.check([key]):
                return None
            everyone.update({int(k): v for k, v in json.loads(store.get(key)).items()})
        except RuntimeError:
            return None
    return everyone
