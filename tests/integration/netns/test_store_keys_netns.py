"""The job's store does not grow with the steps, across three (namespaced) hosts: 3 nodes x 2 ranks, 2,000 steps,
a straggler window of 5 (400 windows of reports from every node) and a rank_zero_first block every 100 steps; node
0's store holds as many keys at step 2,000 as at step 200 (control_plane/keys.py says what each key is and when it
goes; benchmarks/control_plane.py measures the same at 4,096 simulated nodes)."""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from cluster import Cluster
from test_multinode import NODES, PER_NODE, describe, env, run_job

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SCRIPT = str(Path(__file__).with_name("keys_job.py"))


def test_the_store_holds_as_many_keys_after_2000_steps_as_after_200(cluster: Cluster, tmp_path: Path) -> None:
    start = time.monotonic()
    commands = [[sys.executable, "-m", "fabriclite", "run", "--num-nodes", str(NODES), "--node-rank", str(k),
                 "--main-address", cluster.addr(0), "--main-port", "29531", "--devices", str(PER_NODE),
                 "--accelerator", "cpu", SCRIPT] for k in range(NODES)]
    ended = run_job(cluster, tmp_path, [(k, commands[k], env(STEPS=2000, FABRICLITE_STRAGGLER_WINDOW=5))
                                        for k in range(NODES)])
    assert all(e.returncode == 0 for e in ended), describe(ended)
    counts = {int(s): int(n) for s, n in re.findall(r"KEYS step=(\d+) n=(\d+)", ended[0].out)}
    assert set(counts) == {200, 2000}, describe(ended)
    assert counts[2000] <= counts[200], f"{counts}: the store grew with the steps\n{describe(ended)}"
    print(f"{NODES} nodes x {PER_NODE} ranks: {counts[200]} keys at step 200, {counts[2000]} at step 2000 "
          f"({time.monotonic() - start:.0f} s)")
