"""ft lane on three hosts of the network-namespace cluster (tests/integration/netns/cluster.py: each node its own
address and hostname): live recovery across a real (virtual) network, node 0 hosting the lighthouse at its own
address. Node 2's rank is SIGKILLed; nodes 0 and 1 keep committing; node 2 heals from a live peer over the network.
Needs root and network namespaces (skipped otherwise, like tests/integration/netns)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

from ft_harness import StepLog, start_nodes, wait_nodes
from helpers import REPO

sys.path.insert(0, str(REPO / "tests" / "integration" / "netns"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cluster import Cluster, lifetime, unavailable_reason  # noqa: E402
from test_lane_ft import RESTART, RUN_TIMEOUT_S, assert_all_ok, assert_recovered, assert_same_end  # noqa: E402

pytestmark = [pytest.mark.netns, pytest.mark.slow]


@pytest.fixture(scope="module")
def hosts() -> Iterator[Cluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-host tests need network namespaces: {reason}")
    yield from lifetime(3)


def test_a_node_killed_on_another_host_heals_from_a_live_peer(hosts: Cluster, tmp_path: Path) -> None:
    env = {**RESTART, "FT_KILL_GROUP": "2", "FT_KILL_STEP": "30", "FABRICLITE_TIMEOUT": "60"}
    started = start_nodes(tmp_path, 80, args=["--main-address", hosts.addr(0), "--max-restarts", "1"], env=env,
                          port=29531, spawn=lambda rank, cmd, full_env, **kw: hosts.exec(rank, cmd, full_env, **kw))
    nodes = wait_nodes(started, RUN_TIMEOUT_S)
    assert_all_ok(nodes)
    assert_recovered(tmp_path, 2, 30, 0)
    assert_same_end(tmp_path)
    assert StepLog.read(tmp_path, 2).starts[-1][3] == "<live peer>"
