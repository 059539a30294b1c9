"""ft lane: replica groups of several ranks (``fabriclite run --fault-tolerant --devices 2``): 2 local nodes, each
one replica group of 2 ranks with DDP inside, real torchft 0.2.0 Managers (one per rank), node 0's real lighthouse;
the script is ft_train.py (group rank r > 0 writes ``steps-<group>.<r>.txt`` and ``final-<group>.<r>.pt``).

Each test runs one job that checks several cases, to keep the lane's time down. Time bounds (measured on the loaded
2-core machine): the 2 x 2 job of 30 steps took 33-36 s, the plain ddp job of 4 one-rank nodes beside it 27-59 s;
the job with two kills (3 rounds of group 1) took 60-80 s. RUN_TIMEOUT_S is a ~3x margin over the longest."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

from ft_harness import StepLog, clean_env, free_port, start_nodes, wait_nodes

from fabriclite.strategies.torchft.replica_parts import plain_bucket_caps  # noqa: F401 (imports torchft: lane only)

RUN_TIMEOUT_S = 300
STEPS = 30
BY_HAND = Path(__file__).parent / "groups_by_hand.py"
#: the names of the 4 ranks' files: group 0's ranks, then group 1's
RANKS = ("0", "0.1", "1", "1.1")
GROUPS = ["--devices", "2", "--accelerator", "cpu"]
#: the healthy group's longest gap between committed steps around a kill; measured 1.16-1.43 s on the loaded machine
#: (the lighthouse drops a lost group after its 1 s heartbeat timeout); bounded with a ~3x margin
MAX_GAP_S = 5.0


def start_by_hand(out: Path) -> Tuple[subprocess.Popen, List[subprocess.Popen]]:
    """torchft's lighthouse (minimum 2 groups) and the 4 ranks of groups_by_hand.py, started."""
    out.mkdir(parents=True)
    port = free_port()
    lighthouse = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse"), "--bind",
                                   f"127.0.0.1:{port}", "--min_replicas", "2", "--join_timeout_ms", "300",
                                   "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "1000"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stores = [0, 0]  # each group's rank 0 binds a free port itself (a port picked here could be taken meanwhile)
    ranks = []
    for rank, (group, group_rank) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        command = [sys.executable, str(BY_HAND), str(out), str(STEPS), str(group), str(group_rank), "2",
                   str(stores[group]), f"127.0.0.1:{port}"]
        ranks.append(subprocess.Popen(command, stdout=open(out / f"rank{rank}.log", "w"), stderr=subprocess.STDOUT,
                                      env=clean_env({"RUST_LOG": "warn"}), cwd=str(out)))
    return lighthouse, ranks


def load(out: Path, kind: str, name: str) -> Dict[str, torch.Tensor]:
    return torch.load(out / f"{kind}-{name}.pt", weights_only=False)


def assert_ok(nodes: List) -> None:
    for node in nodes:
        assert node.code == 0, f"node {node.rank} exited {node.code}:\n{node.output[-4000:]}"


def assert_equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs (max |diff| {(a[key] - b[key]).abs().max()})"


@pytest.mark.slow
def test_two_groups_of_two_ranks_train_as_ddp_over_four(tmp_path: Path) -> None:
    """No fault: every rank of both groups starts from group 0's rank 0 (init_sync, then group rank 0's state in
    each group), takes the mean gradient over all 4 ranks (within 1e-6 of plain ddp over 4 one-rank nodes on the
    same data shares) and ends with the same weights, bit for bit, as each other and as the same loop written by
    hand on torch and torchft (groups_by_hand.py: a Manager per rank, its own comm hook). Libraries see the job's
    ranks (RANK = group * 2 + group rank, WORLD_SIZE = 4); fabric.world_size is the group's."""
    env = {"FT_SAVE_GRAD": "1", "FT_PACE": "0.01"}
    # --min-replicas 2: every step commits with both groups (a group late by the lighthouse's join timeout would
    # step alone, which the loop by hand, at a minimum of 2, never does)
    ft = start_nodes(tmp_path / "ft", STEPS, nodes=2, args=[*GROUPS, "--min-replicas", "2"], env=env)
    ddp = start_nodes(tmp_path / "ddp", STEPS, nodes=4, fault_tolerant=False, env=env)
    lighthouse, by_hand = start_by_hand(tmp_path / "by_hand")
    try:
        assert_ok(wait_nodes(ft, RUN_TIMEOUT_S))
        assert_ok(wait_nodes(ddp, RUN_TIMEOUT_S))
        for rank, process in enumerate(by_hand):
            process.wait(RUN_TIMEOUT_S)
            assert process.returncode == 0, (rank, (tmp_path / "by_hand" / f"rank{rank}.log").read_text()[-3000:])
    finally:
        for process in (*by_hand, lighthouse):
            process.kill()
            process.wait()
    out = tmp_path / "ft"
    for name in RANKS:  # a hand-written torch + torchft loop over the same 2 x 2 ranks: the same weights, bit for bit
        assert_equal(load(out, "final", name), load(tmp_path / "by_hand", "final", name), f"rank {name} against by hand")
    first = load(out, "initial", "0")
    for name in RANKS:
        assert_equal(load(out, "initial", name), first, f"rank {name}'s initial weights against group 0's rank 0")
        assert_equal(load(out, "final", name), load(out, "final", "0"), f"rank {name}'s final weights")
        log = StepLog.read(out, name)
        assert log.starts[0][:2] == (0, 0) and log.end is not None and log.end[0] == STEPS, (name, log.starts, log.end)
    # the plain ddp job starts from its rank 0's seed, as group 0's rank 0: the same initial weights
    assert_equal(load(tmp_path / "ddp", "initial", "0"), first, "plain ddp's initial weights")
    reference = load(tmp_path / "ddp", "grad", "0")
    for name in RANKS:
        grad = load(out, "grad", name)
        assert grad.keys() == reference.keys()
        worst = max((grad[k] - reference[k]).abs().max().item() for k in grad)
        assert worst <= 1e-6, f"rank {name}'s first gradient is {worst:.2e} off plain ddp's mean over 4 ranks"
    envs = {}
    for name in RANKS:
        line = next(line for line in (out / f"steps-{name}.txt").read_text().splitlines()
                    if line.startswith("process "))
        envs[name] = tuple(line.split()[3:5])
    assert envs == {"0": ("0", "4"), "0.1": ("1", "4"), "1": ("2", "4"), "1.1": ("3", "4")}, envs


@pytest.mark.slow
def test_a_rank_killed_restarts_its_whole_group_which_heals_rank_by_rank(tmp_path: Path) -> None:
    """Group 1's rank 1 is SIGKILLed between steps (step 15), then, in the group's second round, its rank 0 inside
    backward (step 40: in its first layer's gradient hook, its group rank 1 waiting in the bucket's all-reduce).
    Each time both ranks of group 1 restart
    (warm spares) while group 0 keeps committing, and each group rank heals from group 0's rank of the same group
    rank: at the end every rank holds the same weights, optimizer state and state values, bit for bit.

    Traps: the restarted group's rank 0 starts 1.5 s late (``FT_DELAY_RESTARTED_RANK0_S``), so its rank 1 asks the
    group's store for ``manager_addr`` before rank 0 has written this round's (the stale-key trap: it would get the
    dead round's address); the state holds an ``nn.Parameter`` (``FT_PARAM_STATE``; PGTransport refuses them);
    every rank's DDP reports no rebuilt buckets and one bucket layout (the rebuilt-bucket trap).

    Beside it: group 0 starts 3 s late and group 1 waits for it (the job's first quorum holds every group at R = 2
    too), and a second job whose nodes run 2 and 1 ranks ends with the error naming both numbers."""
    env = {"FT_KILL_GROUP": "1", "FT_KILL_PLAN": "0:1:between:15,1:0:backward:40", "FT_WAIT_STARTS": "1:3",
           "FT_WAIT_BACK": "", "FT_DELAY_RESTARTED_RANK0_S": "1.5", "FT_PARAM_STATE": "1", "FT_SAVE_OPT": "1",
           "FT_PACE": "0.05", "FABRICLITE_FIRST_RESTART_BACKOFF": "1", "FABRICLITE_RESTART_BACKOFF": "1"}
    # a job starts together at R = 2 as well: group 0 starts its Managers 3 s late, group 1 waits for it
    env.update({"FT_DELAY_GROUP": "0", "FT_DELAY_S": "3"})
    nodes = start_nodes(tmp_path, 60, nodes=2, args=[*GROUPS, "--max-restarts", "2"], env=env)
    # beside it, a job whose node 1 has one rank where node 0 has two: it ends with the error naming both numbers.
    # A node that finds a live group of another size at the lighthouse ends before its Manager starts (so that a
    # replacement node never stops the live groups); the other node, at the job's start, then ends at its
    # --first-quorum-timeout naming the group that never joined, or with the same error if both met in a quorum
    port = free_port()
    odd_args = ["--accelerator", "cpu", "--first-quorum-timeout", "10"]
    odd = [*start_nodes(tmp_path / "odd", 10, nodes=2, args=[*odd_args, "--devices", "2"], ranks=[0], port=port),
           *start_nodes(tmp_path / "odd", 10, nodes=2, args=[*odd_args, "--devices", "1"], ranks=[1], port=port)]
    nodes, odd = wait_nodes(nodes, RUN_TIMEOUT_S), wait_nodes(odd, RUN_TIMEOUT_S)
    named = []
    for node, other in zip(odd, reversed(odd)):
        assert node.code == 1, node.output[-3000:]
        mine, theirs = (2, 1) if node.rank == 0 else (1, 2)
        if (f"replica group {node.rank} runs {mine} rank(s) per group (--devices {mine}) but replica group "
                f"{other.rank} runs {theirs} (--devices {theirs})") in node.output:
            named.append(node.rank)
        else:
            assert f"group(s) {other.rank} of 2 (--num-nodes) never joined" in node.output, node.output[-3000:]
    assert named, [node.output[-2000:] for node in odd]
    assert_ok(nodes)
    start0 = StepLog.read(tmp_path, "0").starts[0][2]
    for name in ("1", "1.1"):
        assert StepLog.read(tmp_path, name).rows[0][1] >= start0, f"rank {name} stepped before group 0 had started"
        assert_equal(load(tmp_path, "initial", name), load(tmp_path, "initial", "0"), f"rank {name}'s start")
    assert "2 of 2 restarts used" in nodes[1].output, nodes[1].output[-3000:]
    assert "restarting" not in nodes[0].output, nodes[0].output[-3000:]  # the healthy group never stopped
    for name in ("1", "1.1"):  # both ranks of group 1 started 3 times, each restart healed from a live peer
        starts = StepLog.read(tmp_path, name).starts
        assert [s[0] for s in starts] == [0, 1, 2], (name, starts)
        assert all(s[3] == "<live peer>" and s[1] > 0 for s in starts[1:]), (name, starts)
    alive, dead = StepLog.read(tmp_path, "0"), StepLog.read(tmp_path, "1")
    for back in (dead.starts[1][2], dead.starts[2][2]):
        died = max(t for _, t, _ in dead.rows if t < back)
        assert any(died < t < back for t in alive.committed_times()), f"group 0 stalled while group 1 was down"
    gap = alive.longest_gap()
    print(f"group 0's longest gap between committed steps: {gap:.2f} s")
    assert gap <= MAX_GAP_S, f"group 0's longest gap between committed steps was {gap:.2f} s"
    ends = {name: StepLog.read(tmp_path, name).end for name in RANKS}
    assert len({end[0] for end in ends.values()}) == 1, ends
    optim0 = load(tmp_path, "optim", "0")
    for name in RANKS:
        peer = "0" if name in ("0", "1") else "0.1"  # group 0's rank of the same group rank
        assert_equal(load(tmp_path, "final", name), load(tmp_path, "final", peer), f"rank {name}'s weights")
        optim, reference = load(tmp_path, "optim", name), load(tmp_path, "optim", peer)
        for index, values in reference["optimizer"]["state"].items():
            assert_equal(optim["optimizer"]["state"][index], values, f"rank {name}'s optimizer state {index}")
        assert optim["step"] == reference["step"]
        assert torch.equal(optim["scale"].detach(), optim0["scale"].detach()), (name, optim["scale"])
        sizes, rebuilt = optim["buckets"]
        assert not rebuilt and sizes == optim0["buckets"][0], f"rank {name}'s DDP buckets: {optim['buckets']}"
