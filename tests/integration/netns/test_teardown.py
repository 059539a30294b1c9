"""The cluster fixture leaves nothing behind (namespaces, links, /etc/netns entries, processes) when a test
fails, when the run is interrupted, and, after the next run's sweep, when the run is killed outright."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster import Cluster, sweep, unavailable_reason

UNAVAILABLE = unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.slow,
              pytest.mark.skipif(bool(UNAVAILABLE), reason=f"multi-node tests need network namespaces: {UNAVAILABLE}")]

CHILD = Path(__file__).with_name("child_session.py")


def start_child(ending: str) -> tuple:
    """A child pytest running child_session.py; returns it with its cluster's prefix and node processes."""
    child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                              "--confcutdir", str(CHILD.parent), str(CHILD)],
                             env={**os.environ, "CHILD_ENDING": ending}, cwd=CHILD.parents[2],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in child.stderr:
        if line.startswith("CLUSTER "):
            _, prefix, *pids = line.split()
            return child, Cluster(3, prefix), [int(p) for p in pids]
    pytest.fail(f"the child never brought its cluster up:\n{child.communicate(timeout=30)}")


def alive(pid: int) -> bool:
    """Running (a zombie that nobody has reaped yet does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_gone(cluster: Cluster, pids: list) -> None:
    assert cluster.leftovers() == []
    assert [p for p in pids if alive(p)] == []


@pytest.mark.parametrize("ending", ["fail", "interrupt"])
def test_nothing_left_when_a_test_fails_or_the_run_is_interrupted(ending: str) -> None:
    child, cluster, pids = start_child("fail" if ending == "fail" else "wait")
    assert cluster.pids() and cluster.leftovers()
    if ending == "interrupt":
        child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == (1 if ending == "fail" else 2), out + err
    assert_gone(cluster, pids)


def test_a_killed_run_is_swept_by_the_next() -> None:
    child, cluster, pids = start_child("wait")
    child.kill()
    child.wait(timeout=30)
    time.sleep(0.2)
    assert cluster.leftovers() and all(alive(p) for p in pids)
    assert cluster.prefix in sweep()
    assert_gone(cluster, pids)
