"""Faults across nodes and at rendezvous, with real processes: two ``fabriclite run`` nodes on
127.0.0.1 where one node's rank fails, ranks that never arrive, a main port in use, a main address
where nobody answers. Each job ends within its bound with an error naming the node, rank, address
or port, and leaves no process behind."""
from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Dict, List

import pytest

from faults_harness import (END_BOUND_S, Job, assert_nothing_left, cli_job, kill_tree, living, run_jobs,
                            script_job)
from helpers import free_port

pytestmark = pytest.mark.slow


def node(tmp: Path, name: str, node_rank: int, port: int, fail_rank: int, fault: str = "raise") -> Job:
    args = ["--accelerator", "cpu", "--devices", "1", "--num-nodes", "2", "--node-rank", str(node_rank),
            "--main-address", "127.0.0.1", "--main-port", str(port), "--timeout", "60"]
    return cli_job(tmp, name, fault, args, env={"FAIL_RANK": str(fail_rank)})


@pytest.fixture(scope="module")
def node_jobs(tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Job]:
    tmp = tmp_path_factory.mktemp("faults_nodes")
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    busy_port = busy.getsockname()[1]
    port_a, port_b, port_c, port_d, closed = free_port(), free_port(), free_port(), free_port(), free_port()
    jobs: List[Job] = [
        node(tmp, "a_node0", 0, port_a, fail_rank=1),  # node 1's rank fails
        node(tmp, "a_node1", 1, port_a, fail_rank=1),
        node(tmp, "b_node0", 0, port_b, fail_rank=0),  # node 0's rank fails: node 0 hosts the store
        node(tmp, "b_node1", 1, port_b, fail_rank=0),
        node(tmp, "late_node0", 0, port_d, fail_rank=-1, fault="late"),  # no fault: node 1 ends after node 0's rank
        node(tmp, "late_node1", 1, port_d, fail_rank=-1, fault="late"),
        cli_job(tmp, "never_arrive", "raise", ["--accelerator", "cpu", "--devices", "1", "--num-nodes", "2",
                                                "--node-rank", "0", "--main-port", str(port_c), "--timeout", "4"]),
        cli_job(tmp, "no_main", "raise", ["--accelerator", "cpu", "--devices", "1", "--num-nodes", "2",
                                           "--node-rank", "1", "--main-address", "127.0.0.1",
                                           "--main-port", str(closed), "--timeout", "3"]),
        script_job(tmp, "port_in_use", "raise", env={"MASTER_PORT": str(busy_port)}),
        cli_job(tmp, "not_a_store", "raise", ["--accelerator", "cpu", "--devices", "1", "--num-nodes", "2",
                                               "--node-rank", "1", "--main-address", "127.0.0.1",
                                               "--main-port", str(busy_port), "--timeout", "3"]),
    ]
    started = time.time()
    try:
        run_jobs(jobs, at_once=4)  # the two nodes of a job start together (they come in pairs)
    except BaseException:
        for job in jobs:
            kill_tree(job)
        raise
    finally:
        busy.close()
    for job in jobs:
        print(job.summary_line())
    print(f"{len(jobs)} jobs in {time.time() - started:.1f} s")
    return {job.name: job for job in jobs}


@pytest.mark.parametrize("job_name, failed_node", [("a", 1), ("b", 0)])
def test_a_rank_failing_on_one_node_ends_both_nodes(node_jobs: Dict[str, Job], job_name: str,
                                                     failed_node: int) -> None:
    failed = node_jobs[f"{job_name}_node{failed_node}"]
    other = node_jobs[f"{job_name}_node{1 - failed_node}"]
    rank = failed_node  # one rank per node
    fault_at = failed.fault_at
    for job in (failed, other):
        assert job.returncode not in (0, None), job.output
        assert job.ended - fault_at < END_BOUND_S, f"{job.name} ended {job.ended - fault_at:.1f} s after the fault"
    assert f"fabriclite: the job failed: rank {rank} (local rank 0, node {failed_node}) raised ValueError: rank " \
           f"{rank} fails on purpose" in "".join(failed.err), failed.output
    # the other node names the failed node and rank, not only a socket error
    other_err = "".join(other.err)
    assert f"the job failed on node {failed_node}: rank {rank} (local rank 0, node {failed_node}) raised " \
           f"ValueError: rank {rank} fails on purpose" in other_err, other.output
    for job in (failed, other):
        assert_nothing_left(job)


def test_ranks_that_never_arrive_are_named(node_jobs: Dict[str, Job]) -> None:
    job = node_jobs["never_arrive"]
    assert job.returncode == 1, job.output
    err = "".join(job.err)
    assert "ranks [1] of 2 never joined the rendezvous at 127.0.0.1:" in err and "within 4 s" in err, job.output
    waited = job.ended - max(r["before_launch"] for r in job.records if "before_launch" in r)
    assert 4 <= waited < 4 + END_BOUND_S, job.output
    assert_nothing_left(job)


def test_a_main_address_where_nobody_answers(node_jobs: Dict[str, Job]) -> None:
    job = node_jobs["no_main"]
    assert job.returncode == 1, job.output
    err = "".join(job.err)
    assert "could not reach the rendezvous store at 127.0.0.1:" in err and "(timeout 3 s)" in err, job.output
    assert "Traceback" not in err, job.output  # one clear line, not a stack
    assert job.ended - job.cli_ready_at < 3 + END_BOUND_S, job.output
    assert not job.ranks  # no rank was started
    assert not living([job.proc.pid])  # type: ignore[union-attr]


def test_the_main_port_in_use(node_jobs: Dict[str, Job]) -> None:
    job = node_jobs["port_in_use"]
    assert job.returncode == 1, job.output
    err = "".join(job.err)
    assert "fabriclite: main port" in err and "on 127.0.0.1 is already in use by another process" in err, job.output
    assert "Traceback" not in err, job.output
    assert not job.ranks  # no rank was started
    assert not living([job.proc.pid])  # type: ignore[union-attr]


def test_a_main_port_where_something_else_listens(node_jobs: Dict[str, Job]) -> None:
    # a server that accepts connections and never answers (the wrong --main-port): bounded, named
    job = node_jobs["not_a_store"]
    assert job.returncode == 1, job.output
    err = "".join(job.err)
    assert "fabriclite: something answers at 127.0.0.1:" in err and "but it is not a rendezvous store" in err, \
        job.output
    assert job.ended - job.cli_ready_at < 3 + END_BOUND_S, job.output
    assert not job.ranks


def test_a_node_that_ends_later_is_no_failure(node_jobs: Dict[str, Job]) -> None:
    # node 0 keeps the store up while node 1's supervisor is alive: node 1 is not told the store is gone
    first, late = node_jobs["late_node0"], node_jobs["late_node1"]
    for job in (first, late):
        assert job.returncode == 0, job.output
        assert "fabriclite: the job failed" not in "".join(job.err), job.output
    # node 1's rank ended only after it saw node 0's rank process gone (its supervisor then waits for node 1)
    assert any(r.get("node0_rank_gone") for r in late.records), late.output
    done = {r["rank"]: r["at"] for job in (first, late) for r in job.records if r.get("done")}
    assert set(done) == {0, 1} and first.ended >= done[1], (first.output, late.output)
