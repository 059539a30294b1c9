"""Restarts across three (namespaced) hosts: a rank killed on node 2 mid-epoch leads every node to a restart,
agreed in node 0's store, and the run ends with the weights of an uninterrupted 3-node run, bit for bit."""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import List

import pytest
import torch

from cluster import Cluster
from test_multinode import NODES, PER_NODE, describe, env, run_job
from helpers import REPO

pytestmark = [pytest.mark.netns, pytest.mark.slow]

SCRIPT = str(REPO / "tests" / "support" / "restart_script.py")


def cli(cluster: Cluster, node: int, port: int, *flags: str) -> List[str]:
    return [sys.executable, "-m", "fabriclite", "run", "--num-nodes", str(NODES), "--node-rank", str(node),
            "--main-address", cluster.addr(0), "--main-port", str(port), "--devices", str(PER_NODE),
            "--accelerator", "cpu", *flags, SCRIPT]


def test_a_rank_killed_on_node_2_restarts_every_node_and_gives_the_same_weights(cluster: Cluster,
                                                                                  tmp_path: Path) -> None:
    # 3 batches an epoch: 4 is mid-epoch. With 3+ ranks the sums depend on DDP's bucket layout, which plain DDP
    # rebuilds after its first step (a resumed run's first step would use the initial one): find_unused keeps it
    common = dict(STEPS=8, SAVE_EVERY=4, FABRICLITE_RESTART_BACKOFF=0.05, STRATEGY="ddp_find_unused_parameters_true")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ref_env = env(CKPT_DIR=tmp_path / "ref", OUT=tmp_path / "ref.pt", **common)
    ended = run_job(cluster, tmp_path / "a", [(k, cli(cluster, k, 29511), ref_env) for k in range(NODES)])
    assert all(e.returncode == 0 for e in ended), describe(ended)
    killed = 2 * PER_NODE + 1  # local rank 1 on node 2
    kill_env = env(CKPT_DIR=tmp_path / "kill", OUT=tmp_path / "kill.pt", KILL_AT=f"6:{killed}", **common)
    ended = run_job(cluster, tmp_path / "b",
                    [(k, cli(cluster, k, 29512, "--max-restarts", "1"), kill_env) for k in range(NODES)])
    assert all(e.returncode == 0 for e in ended), describe(ended)
    assert f"rank {killed} (local rank 1, node 2) was killed by SIGKILL" in ended[2].err, describe(ended)
    for e in ended:
        assert "round 1: succeeded" in e.err, describe(ended)
    assert "ROUND 1 resumed from step-0004.ckpt at step 4" in ended[0].out, describe(ended)
    killed_at = float(re.search(r"KILLED t=([\d.]+)", ended[2].out).group(1))
    resumed_at = float(re.search(r"ROUND 1 resumed .* t=([\d.]+)", ended[0].out).group(1))
    print(f"3 nodes: failure to training resumed in {resumed_at - killed_at:.1f} s (backoff 0.05 s)")
    ref, got = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "kill.pt")
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
