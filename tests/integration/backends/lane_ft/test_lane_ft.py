"""ft lane: live recovery (``fabriclite run --fault-tolerant``) with real torchft 0.2.0, its real lighthouse (started
by node 0's supervisor) and three local nodes, each its own ``fabriclite run`` process with one rank
(`make env-ft`; collected with FABRICLITE_LANE=ft). The script (ft_train.py) never saves a checkpoint: a group
that resumes ahead of step 0 got its state from a live peer.

Time bounds (measured on the loaded 2-core machine, 3 nodes of this lane plus ~5 other test runs): a run of 160
paced steps takes 25-45 s; the healthy groups' longest gap between committed steps around a fault was
0.4-1.3 s, bounded here by the issue's 10 s; with --timeout 3 the lighthouse-unreachable error reports the
supervisor's 3 s wait (the whole command took 13.8-55 s under load, bounded at 170 s)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from ft_harness import StepLog, final_weights, free_port, start_nodes, wait_nodes

STEPS = 80
#: a run's bound: measured 25-104 s under load (node 0 exits last: it keeps the lighthouse up 3 s more); ~3x margin
RUN_TIMEOUT_S = 300
#: the issue's bound on the healthy groups' longest gap between committed steps on the loaded CI machine
MAX_GAP_S = 10.0
#: a restarted rank is a warm spare and heals within about a second of the kill, faster than the lighthouse drops
#: two lost groups (heartbeat timeout 1 s): a 2 s backoff before the first restart (by default immediate) keeps the
#: node down long enough to see the others commit without it
RESTART = {"FABRICLITE_FIRST_RESTART_BACKOFF": "2", "FABRICLITE_RESTART_BACKOFF": "2", "FT_PACE": "0.05"}


def run_job(out: Path, env: Dict[str, str], args: List[str] = (), steps: int = STEPS) -> List:
    nodes = wait_nodes(start_nodes(out, steps, args=list(args), env={**RESTART, **env}), RUN_TIMEOUT_S)
    return nodes


def assert_all_ok(nodes: List) -> None:
    for node in nodes:
        assert node.code == 0, f"node {node.rank} exited {node.code}:\n{node.output[-4000:]}"


def assert_same_end(out: Path, groups=(0, 1, 2), steps: int = STEPS) -> None:
    weights = [final_weights(out, g) for g in groups]
    ends = {g: StepLog.read(out, g).end for g in groups}
    assert all(end is not None and end[0] >= steps for end in ends.values()), ends
    assert len({end[0] for end in ends.values()}) == 1, f"the groups ended at different steps: {ends}"
    for g, w in zip(groups[1:], weights[1:]):
        assert w.keys() == weights[0].keys()
        for key in w:
            assert torch.equal(w[key], weights[0][key]), f"group {g}'s {key} differs from group {groups[0]}'s"


def assert_recovered(out: Path, killed: int, at: int, witness: int) -> None:
    """``killed`` died at step ``at``; ``witness`` kept committing while it was down, with no long gap; the killed
    group's restart resumed from a live peer at a later step."""
    dead, alive = StepLog.read(out, killed), StepLog.read(out, witness)
    restart = [s for s in dead.starts if s[0] >= 1]
    assert restart, f"group {killed} was not restarted: {dead.starts}"
    back = restart[0][2]
    died = max(t for _, t, _ in dead.rows if t < back)  # its last iteration before the kill
    assert restart[0][1] > at and restart[0][3] == "<live peer>", restart[0]
    during = [t for t in alive.committed_times() if died < t < back]
    assert len(during) > 0, f"group {witness} committed nothing while group {killed} was down ({back - died:.1f} s)"
    gap = alive.longest_gap()
    assert gap <= MAX_GAP_S, f"group {witness}'s longest gap between committed steps was {gap:.2f} s"


@pytest.mark.slow
def test_no_fault_the_job_starts_together_and_ends_with_the_same_weights(tmp_path: Path) -> None:
    # group 0 reaches the first quorum 4 s after the others: with torchft's minimum of 1 group, groups 1 and 2
    # would train alone meanwhile and group 0 would heal into their step; the job's first quorum waits for it
    # instead. Beside it, node 0 of another 2-node job starts alone: its first quorum gives up after
    # --first-quorum-timeout, naming the group that never joined.
    lone = start_nodes(tmp_path / "lone", 10, nodes=2, ranks=[0], args=["--first-quorum-timeout", "3"])
    nodes = run_job(tmp_path, {"FT_DELAY_GROUP": "0", "FT_DELAY_S": "4"}, steps=60)
    assert_all_ok(nodes)
    assert_same_end(tmp_path, steps=60)
    initial = [torch.load(tmp_path / f"initial-{g}.pt") for g in (0, 1, 2)]
    for g in (0, 1, 2):
        log = StepLog.read(tmp_path, g)
        assert log.starts[0][:2] == (0, 0), f"group {g} did not start with the job: {log.starts[0]}"
        assert log.rows[0][0] == 1 and log.rows[0][2] == 1, f"group {g}'s first iteration: {log.rows[0]}"
        # the groups start from different seeds: every one starts from group 0's initial state (init_sync)
        assert all(torch.equal(initial[g][k], initial[0][k]) for k in initial[0]), f"group {g} != group 0 at start"
    delayed = StepLog.read(tmp_path, 0).starts[0][2]
    assert all(StepLog.read(tmp_path, g).rows[0][1] >= delayed for g in (1, 2))  # nobody stepped before it came
    lone = wait_nodes(lone, RUN_TIMEOUT_S)[0]
    assert lone.code == 1, lone.output[-3000:]
    assert ("the job's first quorum did not hold every replica group within --first-quorum-timeout 3 s: group(s) 1 "
            "of 2 (--num-nodes) never joined (the quorum held group(s) 0)") in lone.output, lone.output[-3000:]
    assert not (tmp_path / "lone" / "steps-0.txt").read_text().strip(), "the lone group trained"


@pytest.mark.slow
@pytest.mark.parametrize("killed,witness", [(2, 0), (0, 1)])
def test_a_killed_node_heals_from_a_live_peer_while_the_others_train(tmp_path: Path, killed: int,
                                                                     witness: int) -> None:
    nodes = run_job(tmp_path, {"FT_KILL_GROUP": str(killed), "FT_KILL_STEP": "30"}, ["--max-restarts", "1"])
    assert_all_ok(nodes)
    assert "1 of 1 restarts used" in nodes[killed].output, nodes[killed].output[-3000:]
    for node in nodes:
        if node.rank != killed:
            assert "restarting" not in node.output, node.output[-3000:]  # the healthy nodes never stopped
    assert_recovered(tmp_path, killed, 30, witness)
    assert_same_end(tmp_path)


@pytest.mark.slow
def test_a_kill_inside_the_all_reduce_makes_the_others_retry_not_crash(tmp_path: Path) -> None:
    nodes = run_job(tmp_path, {"FT_KILL_GROUP": "2", "FT_KILL_STEP": "30", "FT_KILL_WHERE": "allreduce"},
                    ["--max-restarts", "1"])
    assert_all_ok(nodes)
    for g in (0, 1):
        rows = StepLog.read(tmp_path, g).rows
        assert any(not ok for _, _, ok in rows), f"group {g} never saw the failed step: {rows[25:40]}"
    assert_recovered(tmp_path, 2, 30, 0)
    assert_same_end(tmp_path)


@pytest.mark.slow
def test_two_nodes_lost_at_once_with_min_replicas_1(tmp_path: Path) -> None:
    nodes = run_job(tmp_path, {"FT_KILL_GROUP": "1,2", "FT_KILL_STEP": "30"}, ["--max-restarts", "1",
                                                                               "--min-replicas", "1"])
    assert_all_ok(nodes)
    assert_recovered(tmp_path, 1, 30, 0)
    assert_recovered(tmp_path, 2, 30, 0)
    assert_same_end(tmp_path)


@pytest.mark.slow
def test_a_node_whose_restarts_are_used_up_fails_alone(tmp_path: Path) -> None:
    nodes = run_job(tmp_path, {"FT_KILL_GROUP": "2", "FT_KILL_STEP": "30", "FT_KILL_ROUNDS": "9", "FT_WAIT_BACK": ""},
                    ["--max-restarts", "1"], steps=80)
    assert nodes[2].code == 137, nodes[2].output[-3000:]  # 128 + SIGKILL, as without --fault-tolerant
    assert "the 1 restarts (--max-restarts) are used up" in nodes[2].output, nodes[2].output[-3000:]
    assert nodes[0].code == 0 and nodes[1].code == 0, (nodes[0].output[-3000:], nodes[1].output[-3000:])
    assert_same_end(tmp_path, groups=(0, 1), steps=80)


@pytest.mark.slow
def test_an_unreachable_lighthouse_is_one_line_naming_it(tmp_path: Path) -> None:
    start = time.monotonic()
    nodes = wait_nodes(start_nodes(tmp_path, 10, args=["--timeout", "3"], ranks=[1], port=1), 180)
    took = time.monotonic() - start
    lines = [line for line in nodes[0].output.splitlines() if line.strip()]
    assert nodes[0].code == 1, nodes[0].output
    assert len(lines) == 1 and "could not reach the lighthouse at 127.0.0.1:1 within 3 s (timeout 3 s)" in lines[0], \
        nodes[0].output  # the supervisor's own wait: the --timeout, to the second
    # the whole command, interpreter start under load included: measured 13.8 s and 55 s on the loaded machine
    assert took < 170, took


@pytest.mark.slow
@pytest.mark.parametrize("args,expected", [
    (["--strategy", "fsdp"], "--fault-tolerant with --strategy fsdp is not supported"),
    (["--strategy", "diloco", "--devices", "2"], "--fault-tolerant --strategy diloco with --devices 2: DiLoCo and "
                                                 "LocalSGD run one rank per replica group for now"),
    (["--min-replicas", "4"], "--min-replicas 4 is out of range for --num-nodes 3"),
    # DiLoCo's settings, refused before the lighthouse or a Manager exists (each one's message: the unit tests)
    (["--strategy", "diloco", "--sync-every", "7", "--fragments", "2"], "sync_every=7 is not divisible by fragments=2"),
    (["--strategy", "diloco", "--sync-every", "2", "--fragments", "3"], "sync_every=2 is smaller than fragments=3"),
    (["--strategy", "diloco", "--sync-every", "10", "--fragments", "2", "--fragment-sync-delay", "5"],
     "fragment_sync_delay=5 must be >= 0 and below sync_every / fragments = 5"),
    (["--strategy", "diloco", "--sync-every", "10", "--fragment-update-alpha", "1.5"],
     "fragment_update_alpha=1.5 must be a number in [0, 1]"),
    (["--strategy", "local_sgd", "--sync-every", "10", "--fragments", "2"], "strategy='local_sgd' averages the "
                                                                             "parameters and has no fragments"),
])
def test_refused_combinations_start_nothing(tmp_path: Path, args: List[str], expected: str) -> None:
    nodes = wait_nodes(start_nodes(tmp_path, 10, args=args, ranks=[0]), 60)
    lines = [line for line in nodes[0].output.splitlines() if line.strip()]
    assert nodes[0].code == 2, nodes[0].output
    assert lines[-1].startswith("fabriclite run: error: ") and expected in lines[-1], nodes[0].output
    assert not (tmp_path / "steps-0.txt").exists()


@pytest.mark.slow
def test_an_external_lighthouse_started_with_torchfts_command(tmp_path: Path) -> None:
    port = free_port()
    command = [os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse"), "--bind", f"[::]:{port}",
               "--min_replicas", "1", "--join_timeout_ms", "300", "--heartbeat_timeout_ms", "1000"]
    lighthouse = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        nodes = wait_nodes(start_nodes(tmp_path, 30, nodes=2, args=["--lighthouse", f"127.0.0.1:{port}"],
                                       env={"FT_PACE": "0.02"}), RUN_TIMEOUT_S)
        assert_all_ok(nodes)
        assert_same_end(tmp_path, groups=(0, 1), steps=30)
        assert lighthouse.poll() is None  # node 0 neither started its own nor stopped this one
    finally:
        lighthouse.kill()
        lighthouse.wait()


@pytest.mark.slow
def test_saves_never_wait_for_a_dead_group_and_a_relaunch_reads_the_disk(tmp_path: Path) -> None:
    env = {"FT_SAVE_EVERY": "1", "FT_KILL_GROUP": "2", "FT_KILL_STEP": "25"}  # every step: any commit is saved
    assert_all_ok(run_job(tmp_path, env, ["--max-restarts", "1"], steps=60))
    dead = StepLog.read(tmp_path, 2)
    back = next(t for r, t in dead.processes if r >= 1)
    died = max(t for _, t, _ in dead.rows if t < back)
    # group 0 completed a save while group 2 was down (it commits in that window: assert_recovered's check)
    saves = StepLog.read(tmp_path, 0).saves
    assert any(died < t < back for _, t in saves), (died, back, saves)
    first = {g: StepLog.read(tmp_path, g).end[0] for g in (0, 1, 2)}
    # every group is gone: in the next launch the first group to start has no live peer ahead and reads its newest
    # checkpoint from disk; a group starting after it has committed a step heals from it instead
    for log in tmp_path.glob("steps-*.txt"):
        log.rename(log.with_suffix(".first"))
    assert_all_ok(run_job(tmp_path, {"FT_SAVE_EVERY": "1"}, steps=first[0] + 20))
    starts = {g: StepLog.read(tmp_path, g).starts[0] for g in (0, 1, 2)}
    from_disk = [g for g, s in starts.items() if s[3].endswith(f"checkpoints-{g}/step-{first[g]:04d}.ckpt")]
    assert from_disk, starts
    assert all(s[1] >= first[0] and (g in from_disk or s[3] == "<live peer>") for g, s in starts.items()), starts
    assert_same_end(tmp_path, steps=first[0] + 20)


@pytest.mark.slow
def test_a_hung_group_is_found_by_its_supervisor_with_its_stack_and_heals(tmp_path: Path) -> None:
    # group 2's rank sleeps in user code after step 30; its supervisor's step watch (3 s) finds it hung while the
    # others wait on it, takes its stack, and restarts it as a failed group; it heals from a live peer
    nodes = run_job(tmp_path, {"FT_HANG_GROUP": "2", "FT_HANG_STEP": "30", "FT_WAIT_BACK": "2",
                               "FABRICLITE_HANG_TIMEOUT": "3"}, ["--max-restarts", "1"])
    assert_all_ok(nodes)
    out = nodes[2].output
    # each group is a job of its own (its one node is "node 0" inside it): the header names the group
    assert "fabriclite: replica group 2 of 3 (--fault-tolerant):\nfabriclite: the job is hung: no rank of node 0 " \
           "completed an optimizer step for" in out, out[-4000:]
    assert "--- live stacks of node 0's ranks (hung; all threads;" in out, out[-4000:]
    line = next(i + 1 for i, text in enumerate((Path(__file__).parent / "ft_train.py").read_text().splitlines())
                if "FT-HANG" in text)
    assert f'ft_train.py", line {line}, in ' in out, out[-4000:]  # the stuck frame, taken while alive
    assert "1 of 1 restarts used" in out, out[-3000:]
    for node in nodes[:2]:
        assert "the job is hung" not in node.output and "restarting" not in node.output, node.output[-3000:]
    restart = [s for s in StepLog.read(tmp_path, 2).starts if s[0] >= 1]
    assert restart and restart[0][3] == "<live peer>", restart
    assert_same_end(tmp_path)
    goodput = [line for line in out.splitlines() if line.startswith("fabriclite: goodput")]
    assert goodput and "redone steps 0.0 s (0 steps)" in goodput[-1], goodput  # healed: nothing redone
