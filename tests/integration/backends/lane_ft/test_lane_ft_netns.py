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


#: from the cut to the partitioned group's end: its lighthouse heartbeat timeout (8 s) plus a probe interval and
#: its ranks' stop (~5 s), with a margin for a loaded 2-core machine
PARTITION_BOUND_S = 8.0 + 15.0


def _without_noise(log: str) -> str:
    """A node's log without c10d's warning that a namespace host's client socket has no name (one per connection)."""
    return "\n".join(line for line in log.splitlines() if "hostname of the client socket cannot be retrieved" not in line)


def test_a_partitioned_group_is_dropped_ends_itself_and_heals_once_the_link_is_back(hosts: Cluster,
                                                                                   tmp_path: Path) -> None:
    import subprocess
    import time

    from ft_harness import StepLog

    env = {**RESTART, "FABRICLITE_TIMEOUT": "20", "FT_WAIT_STARTS": "2:2"}  # the others wait for node 2's relaunch
    args = ["--main-address", hosts.addr(0), "--max-restarts", "1", "--heartbeat-timeout", "8"]

    def spawn(rank, cmd, full_env, **kw):
        return hosts.exec(rank, cmd, full_env, **kw)

    def link(state: str) -> None:
        subprocess.run(["ip", "-n", hosts.hub, "link", "set", hosts.host(2), state], check=True)

    def committed(group: int) -> int:
        path = tmp_path / f"steps-{group}.txt"
        return max((s for s, _, ok in StepLog.read(tmp_path, group).rows if ok), default=0) if path.exists() else 0

    started = start_nodes(tmp_path, 120, args=args, env=env, port=29532, spawn=spawn)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while committed(2) < 20:
            assert time.monotonic() < deadline and all(n.process.poll() is None for n in started), \
                [(n.rank, n.process.poll(), _without_noise(n.log_path.read_text())[-3000:]) for n in started]
            time.sleep(0.1)
        cut, at_cut = time.monotonic(), committed(0)
        link("down")
        partitioned = started[2].process
        try:
            partitioned.wait(PARTITION_BOUND_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the partitioned group still runs {PARTITION_BOUND_S:.0f} s after the cut:\n"
                                 f"{started[2].log_path.read_text()[-3000:]}")
        ended = time.monotonic() - cut
        output = started[2].log_path.read_text()
        assert partitioned.returncode not in (0, None), output
        assert (f"fabriclite: node 2 lost the lighthouse: the lighthouse at {hosts.addr(0)}:29532 is unreachable "
                f"since ") in output, output
        while committed(0) <= at_cut + 5:  # the other groups drop it from the quorum and go on
            assert time.monotonic() - cut < 60, started[0].log_path.read_text()[-3000:]
            time.sleep(0.1)
        dropped = time.monotonic() - cut
    finally:
        link("up")
    back = start_nodes(tmp_path, 120, args=args, env=env, port=29532, spawn=spawn, ranks=[2])  # its log anew
    nodes = wait_nodes([started[0], started[1], *back], RUN_TIMEOUT_S)
    assert_all_ok(nodes)
    assert StepLog.read(tmp_path, 2).starts[-1][3] == "<live peer>"
    assert_same_end(tmp_path)
    print(f"partitioned group ended {ended:.1f} s after the cut; group 0 committed again {dropped:.1f} s after it")
