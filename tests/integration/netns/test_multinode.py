"""Three nodes x two ranks across real (namespaced) hosts: fabriclite run, script mode, torchrun, SLURM and
Open MPI contracts, and a fault on node 1. Every job runs tests/integration/netns/job.py, one JSON line per rank."""
from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest

from cluster import Cluster
from faults_harness import END_BOUND_S

pytestmark = [pytest.mark.netns, pytest.mark.slow]

JOB = str(Path(__file__).with_name("job.py"))
NODES, PER_NODE = 3, 2
WORLD = NODES * PER_NODE
FABRIC_KWARGS = json.dumps({"devices": PER_NODE, "num_nodes": NODES})
JOB_TIMEOUT_S = 180
#: variables through which a scheduler or launcher tells a process who it is: never inherited by a job
CLUSTER_VARS = re.compile(
    r"^(SLURM_|OMPI_|PMI_|PMIX_|MV2_|LSB_|JSM_|TORCHELASTIC_|FABRICLITE_(?!JOB_SECRET_FILE$)|GLOO_|MASTER_ADDR$|MASTER_PORT$|RANK$|"
    r"WORLD_SIZE$|LOCAL_RANK$|LOCAL_WORLD_SIZE$|NODE_RANK$|GROUP_RANK$)"
)


def env(**extra: object) -> Dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not CLUSTER_VARS.match(k)}
    base.update(PYTHONUNBUFFERED="1", FABRICLITE_TIMEOUT="60", OMP_NUM_THREADS="1")
    return {**base, **{k: str(v) for k, v in extra.items()}}


@dataclass
class Ended:
    node: int
    returncode: int
    end: float
    out: str
    err: str


def run_job(cluster: Cluster, tmp_path: Path, procs: Sequence[Tuple[int, List[str], Dict[str, str]]],
            timeout: float = JOB_TIMEOUT_S) -> List[Ended]:
    """Start every ``(node, cmd, env)``, wait for all (killing everything after ``timeout``), and check that
    no process is left in any node."""
    started = []
    events = tmp_path / "events"  # the job's ranks observe each other through files here (job.py)
    events.mkdir()
    for i, (node, cmd, proc_env) in enumerate(procs):
        proc_env = {**proc_env, "JOB_EVENTS": str(events)}
        out, err = tmp_path / f"{i}.node{node}.out", tmp_path / f"{i}.node{node}.err"
        with out.open("w") as o, err.open("w") as e:
            started.append((node, cluster.exec(node, cmd, proc_env, stdout=o, stderr=e), out, err))
    ends: Dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(ends) < len(started) and time.monotonic() < deadline:
        for i, (_, proc, _, _) in enumerate(started):
            if i not in ends and proc.poll() is not None:
                ends[i] = time.time()
        time.sleep(0.05)
    if len(ends) < len(started):
        cluster.kill_all()
    ended = [Ended(node, proc.wait(), ends.get(i, float("inf")), out.read_text(), err.read_text())
             for i, (node, proc, out, err) in enumerate(started)]
    if len(ends) < len(started):
        pytest.fail(f"job still running after {timeout} s:\n{describe(ended)}")
    left_deadline = time.monotonic() + 10  # processes of an ended job may take a moment to be reaped
    while cluster.pids() and time.monotonic() < left_deadline:
        time.sleep(0.05)
    assert cluster.pids() == [], f"processes left in the nodes: {cluster.pids()}\n{describe(ended)}"
    return ended


def describe(ended: List[Ended]) -> str:
    return "\n".join(f"--- node {e.node} exit {e.returncode}\n{e.out}{e.err[-3000:]}" for e in ended)


def results(ended: List[Ended]) -> List[dict]:
    """Every rank's RESULT line, in global rank order; asserts every process exited 0."""
    assert all(e.returncode == 0 for e in ended), describe(ended)
    found = [json.loads(line[len("RESULT "):]) for e in ended for line in e.out.splitlines()
             if line.startswith("RESULT ")]
    return sorted(found, key=lambda r: r["global_rank"])


def check_job(cluster: Cluster, ended: List[Ended], environment: str) -> None:
    """What every job must show, whoever started its ranks."""
    ranks = results(ended)
    assert [r["global_rank"] for r in ranks] == list(range(WORLD)), describe(ended)
    for r in ranks:
        node, local = divmod(r["global_rank"], PER_NODE)
        assert (r["node_rank"], r["local_rank"], r["world_size"], r["num_nodes"]) == (node, local, WORLD, NODES), r
        assert r["hostname"] == cluster.host(node), r  # really on that node
        assert r["environment"] == environment, r
        assert r["all_reduce"] == {"vec": [15.0, 30.0], "int": 15, "list": [21.0]}, r
        assert r["all_gather"] == {"rank": list(range(WORLD)), "pair": [[g, -g] for g in range(WORLD)]}, r
    for node in range(NODES):  # each node's local rank 0 ran its block while every other node's did (not in turn),
        zero, *others = (ranks[node * PER_NODE + local]["zero_first"] for local in range(PER_NODE))
        assert zero == {"all_nodes_in_at_once": True}, (node, zero)
        for other in others:  # ... and before the node's other ranks entered theirs
            assert other == {"zero_done_seen": True}, (node, other)


def check_prints(ended: List[Ended]) -> None:
    """``fabric.print`` printed once per node (each node's processes share one output here)."""
    printed = [line for e in ended for line in e.out.splitlines() if line.startswith("PRINTED")]
    assert sorted(printed) == [f"PRINTED node={k} rank={k * PER_NODE}" for k in range(NODES)], describe(ended)


def cli(cluster: Cluster, node: int, port: int, *script_args: str) -> List[str]:
    launcher = Path(sys.executable).with_name("fabriclite")
    prog = [str(launcher)] if launcher.exists() else [sys.executable, "-m", "fabriclite"]
    return [*prog, "run", "--num-nodes", str(NODES), "--node-rank", str(node), "--main-address", cluster.addr(0),
            "--main-port", str(port), "--devices", str(PER_NODE), "--accelerator", "cpu", JOB, *script_args]


def test_fabriclite_run(cluster: Cluster, tmp_path: Path) -> None:
    ended = run_job(cluster, tmp_path, [(k, cli(cluster, k, 29501), env()) for k in range(NODES)])
    check_job(cluster, ended, "FabricliteEnvironment")
    check_prints(ended)


def test_script_mode(cluster: Cluster, tmp_path: Path) -> None:
    procs = [(k, [sys.executable, JOB], env(JOB_FABRIC_KWARGS=FABRIC_KWARGS, NODE_RANK=k,
                                            MASTER_ADDR=cluster.host(0), MASTER_PORT=29502)) for k in range(NODES)]
    ended = run_job(cluster, tmp_path, procs)
    check_job(cluster, ended, "FabricliteEnvironment")
    check_prints(ended)


def test_torchrun(cluster: Cluster, tmp_path: Path) -> None:
    def torchrun(k: int) -> List[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node",
                str(PER_NODE), "--node-rank", str(k), "--master-addr", cluster.host(0), "--master-port", "29503", JOB]

    ended = run_job(cluster, tmp_path, [(k, torchrun(k), env(JOB_FABRIC_KWARGS=FABRIC_KWARGS)) for k in range(NODES)])
    check_job(cluster, ended, "TorchElasticEnvironment")
    check_prints(ended)


def per_rank(cluster: Cluster, tmp_path: Path, rank_env) -> List[Ended]:
    """One process per rank, started by the test as srun / mpirun would, with ``rank_env(node, local, rank)``."""
    procs = [(node, [sys.executable, JOB], env(JOB_FABRIC_KWARGS=FABRIC_KWARGS, **rank_env(node, local, rank)))
             for rank in range(WORLD) for node, local in [divmod(rank, PER_NODE)]]
    return run_job(cluster, tmp_path, procs)


def test_slurm(cluster: Cluster, tmp_path: Path) -> None:
    nodelist = f"{cluster.prefix}n[0-{NODES - 1}]"  # the main address is its first host; the port comes from the job id

    def slurm(node: int, local: int, rank: int) -> Dict[str, object]:
        return dict(SLURM_JOB_ID=4504, SLURM_JOB_NAME="netns", SLURM_NTASKS=WORLD, SLURM_NPROCS=WORLD,
                    SLURM_PROCID=rank, SLURM_LOCALID=local, SLURM_NODEID=node, SLURM_NNODES=NODES,
                    SLURM_JOB_NUM_NODES=NODES, SLURM_NODELIST=nodelist, SLURM_JOB_NODELIST=nodelist,
                    SLURM_STEP_NODELIST=nodelist, SLURM_TASKS_PER_NODE=f"{PER_NODE}(x{NODES})",
                    SLURM_STEP_TASKS_PER_NODE=f"{PER_NODE}(x{NODES})", SLURMD_NODENAME=cluster.host(node))

    check_job(cluster, per_rank(cluster, tmp_path, slurm), "SLURMEnvironment")


def test_openmpi(cluster: Cluster, tmp_path: Path) -> None:
    def mpi(node: int, local: int, rank: int) -> Dict[str, object]:  # `mpirun -x MASTER_ADDR -x MASTER_PORT`
        return dict(OMPI_COMM_WORLD_SIZE=WORLD, OMPI_COMM_WORLD_RANK=rank, OMPI_COMM_WORLD_LOCAL_RANK=local,
                    OMPI_COMM_WORLD_LOCAL_SIZE=PER_NODE, OMPI_COMM_WORLD_NODE_RANK=local,
                    OMPI_UNIVERSE_SIZE=WORLD, OMPI_MCA_ess_base_jobid="3604217857", PMIX_RANK=rank,
                    MASTER_ADDR=cluster.addr(0), MASTER_PORT=29505)

    check_job(cluster, per_rank(cluster, tmp_path, mpi), "MPIEnvironment")


def test_fault_on_node1_ends_every_node(cluster: Cluster, tmp_path: Path) -> None:
    failing = PER_NODE + 1  # global rank 3: local rank 1 on node 1
    # the run's deadline only guards against a hang (starting 9 processes that import torch takes minutes on a
    # loaded machine); what is asserted is how soon every node ended after the rank raised
    ended = run_job(cluster, tmp_path, [(k, cli(cluster, k, 29506), env(JOB_FAIL_RANK=failing)) for k in range(NODES)])
    raised = [json.loads(line[len("RAISING "):]) for e in ended for line in e.out.splitlines()
              if line.startswith("RAISING ")]
    assert [r["rank"] for r in raised] == [failing], describe(ended)
    assert all(e.returncode != 0 for e in ended), describe(ended)
    took = max(e.end for e in ended) - raised[0]["time"]
    # END_BOUND_S: the measured worst case of a job's end after a fault, with its stated margin (faults_harness)
    assert took < END_BOUND_S, f"the job took {took:.1f} s to end after rank {failing} raised\n{describe(ended)}"
    for e in ended:
        assert f"rank {failing} (local rank 1, node 1)" in e.err, describe(ended)
    assert f"injected failure on rank {failing}" in ended[1].err


def test_hostname_on_loopback_like_debian(cluster: Cluster, tmp_path: Path) -> None:
    """Debian/Ubuntu map the hostname to 127.0.1.1: gloo alone would listen on loopback and time out; the
    ranks pick the interface that routes to the main address instead (GLOO_SOCKET_IFNAME unset)."""
    hosts = [Path("/etc/netns") / cluster.host(k) / "hosts" for k in range(NODES)]
    originals = [h.read_text() for h in hosts]
    try:
        for k, (h, text) in enumerate(zip(hosts, originals)):
            head, _, rest = text.partition("\n")  # keep the tag line first: the fixture knows its files by it
            h.write_text(f"{head}\n127.0.1.1 {cluster.host(k)}\n{rest}")
        ended = run_job(cluster, tmp_path, [(k, cli(cluster, k, 29507), env())
                                            for k in range(NODES)])
        check_job(cluster, ended, "FabricliteEnvironment")
    finally:
        for h, text in zip(hosts, originals):
            h.write_text(text)
