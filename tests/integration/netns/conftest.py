"""The ``cluster`` fixture: three hosts made of Linux network namespaces, up once per session.

Teardown (processes, namespaces, links, /etc/netns entries) runs in the fixture's finalizer, in an
atexit hook (an interrupted run), and, for runs killed outright, in the next run's sweep of clusters
whose owner pid is gone.
"""
from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from cluster import Cluster, lifetime, unavailable_reason  # noqa: E402

#: three hosts for the jobs, and a fourth that joins no job: the hostile-network test's attacker
NUM_NODES = 4


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """Four nodes: ``cluster.exec(node, cmd, env, **popen_kwargs) -> Popen`` runs in node 0, 1, 2 or 3
    (address ``cluster.addr(node)``, hostname ``cluster.host(node)``)."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-node tests need network namespaces: {reason}")
    yield from lifetime(NUM_NODES)
