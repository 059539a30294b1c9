"""Network faults on the namespace hosts (3 hosts, `fabriclite run --timeout 30 --heartbeat-timeout 10`, a DDP job):
a host's link down for good, the store host's link down, a 3 s flap, and one case with 2 ranks per host. Each fault
comes at step FAULT_AT (rank 0 says when). Each case asserts the bound (from the fault to every process of the job
gone), the exit codes, the named node in every node's summary, and that no process is left; the flap ends with the
weights of the unfaulted run, bit for bit, and no process of the job listens on every interface. The link goes down at the bridge (the host's port on the switch): both
sides see silence, as with a pulled cable, not an error."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from cluster import Cluster

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(900)]

JOB = str(Path(__file__).with_name("network_faults_job.py"))
NODES = 3
HEARTBEAT_S = 10.0
#: from the fault to every process of the job gone: the heartbeat timeout, then a pulse interval (1.5 s) for the
#: others to read the failure, the ranks' stop (SIGTERM; 3 s grace before SIGKILL) and the supervisors' exit; 10 s
#: on top of the heartbeat timeout leaves a margin of 2x over those parts' ~5 s on a loaded 2-core machine
BOUND_S = HEARTBEAT_S + 10.0
START_S = 180.0  # start-up to the fault step: 3 supervisors and their ranks importing torch on 2 loaded cores
_port = [29610]


class Job:
    """One `fabriclite run` per node, started in the node's namespace; output in files under ``folder``."""

    def __init__(self, cluster: Cluster, folder: Path, devices: int = 1, steps: int = 400) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.cluster, self.folder = cluster, folder
        _port[0] += 1
        self.port = _port[0]
        self.procs: List[subprocess.Popen] = []
        self.out = [folder / f"node{k}.out" for k in range(NODES)]
        self.err = [folder / f"node{k}.err" for k in range(NODES)]
        self.weights = folder / "w.pt"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("FABRICLITE_", "MASTER_", "SLURM_"))
                or k == "FABRICLITE_JOB_SECRET_FILE"}  # the suite's secret (tests/conftest.py): its jobs run closed
        for k in range(NODES):
            cmd = [sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", str(devices),
                   "--num-nodes", str(NODES), "--node-rank", str(k), "--main-address", cluster.host(0),
                   "--main-port", str(self.port), "--timeout", "30", "--heartbeat-timeout", str(HEARTBEAT_S), JOB]
            env = {**base, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "STEPS": str(steps),
                   "OUT": str(self.weights)}
            with self.out[k].open("w") as o, self.err[k].open("w") as e:
                self.procs.append(cluster.exec(k, cmd, env, stdout=o, stderr=e))

    def wait_for_fault_step(self) -> None:
        deadline = time.monotonic() + START_S
        while "AT " not in self.out[0].read_text():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.cluster.kill_all()
                raise AssertionError(f"the job never reached the fault step:\n{self.logs()}")
            time.sleep(0.05)

    def finish(self, within_s: float) -> List[float]:
        """Each node's end (monotonic), all within ``within_s`` (else everything is killed and the test fails); and no
        process is left in any host."""
        ends: Dict[int, float] = {}
        deadline = time.monotonic() + within_s
        while len(ends) < NODES and time.monotonic() < deadline:
            for k, proc in enumerate(self.procs):
                if k not in ends and proc.poll() is not None:
                    ends[k] = time.monotonic()
            time.sleep(0.05)
        if len(ends) < NODES:
            left = self.cluster.pids()
            self.cluster.kill_all()
            raise AssertionError(f"nodes {sorted(set(range(NODES)) - set(ends))} still running {within_s:.0f} s "
                                 f"after the fault (processes {left}):\n{self.logs()}")
        deadline = time.monotonic() + 2.0  # the supervisors are gone; their ranks and helpers must be too
        while self.cluster.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self.cluster.pids(), f"processes left: {self.cluster.pids()}\n{self.logs()}"
        return [ends[k] for k in range(NODES)]

    @property
    def codes(self) -> List[Optional[int]]:
        return [p.returncode for p in self.procs]

    def summary(self, node: int) -> str:
        """Node ``node``'s supervisor lines (its ranks' forwarded output left out)."""
        return "\n".join(line for line in self.err[node].read_text().splitlines() if line.startswith(("fabriclite",
                                                                                                       "  ")))

    def logs(self) -> str:
        return "\n".join(f"--- node {k} (exit {p.returncode}) ---\n{self.err[k].read_text()[-3000:]}"
                         for k, p in enumerate(self.procs))


def assert_no_wildcard_listener(cluster: Cluster) -> None:
    """In each host, no listening TCP socket of the job's processes is on every interface (``*``, ``0.0.0.0``,
    ``[::]``): the store listens on node 0's address, gloo on each host's."""
    for node in range(NODES):
        wide = cluster.wildcard_listeners(node)
        assert not wide, f"node {node} listens on every interface:\n" + "\n".join(wide)


def set_link(cluster: Cluster, node: int, state: str) -> None:
    """Node ``node``'s port on the bridge up or down."""
    subprocess.run(["ip", "-n", cluster.hub, "link", "set", cluster.host(node), state], check=True)


@pytest.fixture()
def links(cluster: Cluster):
    yield cluster
    for node in range(NODES):  # whatever a failed test left down comes back for the next one
        set_link(cluster, node, "up")


def fault_and_finish(job: Job, fault) -> float:
    """Fault the network at the fault step; the seconds from the fault to the last node's end (asserted <= BOUND_S)."""
    job.wait_for_fault_step()
    faulted = time.monotonic()
    fault()
    ends = job.finish(BOUND_S + 30)
    took = max(ends) - faulted
    assert took <= BOUND_S, f"{took:.1f} s from the fault to every process gone (bound {BOUND_S:.0f} s)\n{job.logs()}"
    return took


@pytest.mark.parametrize("devices", [1, 2], ids=["1-rank-per-host", "2-ranks-per-host"])
def test_a_host_whose_link_goes_down_for_good_is_named_by_every_node(links: Cluster, tmp_path: Path,
                                                                     devices: int) -> None:
    lost = 2 if devices == 1 else 1
    job = Job(links, tmp_path / "down", devices=devices, steps=100000)
    took = fault_and_finish(job, lambda: set_link(links, lost, "down"))
    assert all(code not in (0, None) for code in job.codes), (job.codes, job.logs())
    ranks = list(range(lost * devices, (lost + 1) * devices))
    for node in range(NODES):
        summary = job.summary(node)
        if node == lost:
            assert (f"fabriclite: node {lost} lost the job's store: the job's store on node 0 "
                    f"({links.host(0)}:{job.port}) is unreachable since ") in summary, summary
        else:  # the others name the node that went away, not a rank's collective timeout
            first = next(line for line in summary.splitlines() if line.startswith("fabriclite: the job failed"))
            assert first.startswith(f"fabriclite: the job failed: node {lost} ({links.host(lost)}, "
                                    f"{links.addr(lost)}) stopped answering at "), summary
            assert first.endswith(f"its ranks: {ranks}"), first
    print(f"link down ({devices} rank(s) per host): every process gone {took:.1f} s after the fault")


def test_the_store_hosts_link_down_is_named_by_every_other_node(links: Cluster, tmp_path: Path) -> None:
    job = Job(links, tmp_path / "store", steps=100000)
    took = fault_and_finish(job, lambda: set_link(links, 0, "down"))
    assert all(code not in (0, None) for code in job.codes), (job.codes, job.logs())
    for node in (1, 2):
        assert (f"fabriclite: node {node} lost the job's store: the job's store on node 0 ({links.host(0)}:{job.port}) "
                f"is unreachable since ") in job.summary(node), job.summary(node)
    assert (f"fabriclite: the job failed: nodes 1 ({links.host(1)}, {links.addr(1)}, ranks [1]), 2 ({links.host(2)}, "
            f"{links.addr(2)}, ranks [2]) stopped answering (every other node: is node 0's own link down?)") \
        in job.summary(0), job.summary(0)
    print(f"store host down: every process gone {took:.1f} s after the fault")


def test_a_flap_shorter_than_the_bounds_changes_nothing(links: Cluster, tmp_path: Path) -> None:
    reference = Job(links, tmp_path / "reference")
    reference.finish(START_S + 120)
    assert reference.codes == [0, 0, 0], reference.logs()
    job = Job(links, tmp_path / "flap")
    job.wait_for_fault_step()
    assert_no_wildcard_listener(links)
    set_link(links, 2, "down")
    time.sleep(3.0)
    set_link(links, 2, "up")
    job.finish(START_S + 120)
    assert job.codes == [0, 0, 0], job.logs()
    assert "stopped answering" not in job.logs() and "lost the job's store" not in job.logs()
    want, got = torch.load(reference.weights), torch.load(job.weights)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def shape(cluster: Cluster, node: int, rate: Optional[str]) -> None:
    """Node ``node``'s outgoing link shaped to ``rate`` (a tc token bucket), or back to full speed (None)."""
    ns = ["ip", "netns", "exec", cluster.host(node), "tc", "qdisc"]
    if rate is None:
        subprocess.run([*ns, "del", "dev", "eth0", "root"], capture_output=True)
    else:
        subprocess.run([*ns, "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "4kb", "latency", "500ms"],
                       check=True)


#: from shaping the link to node 1's report on node 1 and node 0: SLOW_PULSES pulses that each take over SLOW_RTT_S
#: (a pulse every 1.5 s plus its slow round trip: ~4 x 3 s), and node 0's next read; 2x margin
GRAY_BOUND_S = 60.0


def test_a_gray_link_is_reported_naming_the_node_and_its_rates_and_the_job_goes_on(links: Cluster,
                                                                                    tmp_path: Path) -> None:
    job = Job(links, tmp_path / "gray", steps=100000)
    job.wait_for_fault_step()
    shaped = time.monotonic()
    shape(links, 1, "50kbit")
    try:
        _report_then_stop(job, links, shaped)
    finally:
        shape(links, 1, None)
        links.kill_all()  # a job that failed the test does not outlive it (it would run its 100,000 steps)


def _report_then_stop(job: Job, links: Cluster, shaped: float) -> None:
    try:
        line = f"fabriclite: node 1 ({links.host(1)}) has a slow link to the job's store on node 0: its heartbeats take "
        while not all(line in job.err[k].read_text() for k in (0, 1)):
            assert time.monotonic() - shaped < GRAY_BOUND_S, f"no slow-link report within {GRAY_BOUND_S:.0f} s\n" \
                                                              f"{job.logs()}"
            assert all(p.poll() is None for p in job.procs), job.logs()
            time.sleep(0.2)
        reported = time.monotonic() - shaped
    finally:
        shape(links, 1, None)
    report = next(x for x in job.err[1].read_text().splitlines() if x.startswith(line))
    assert "its ranks step at " in report and " steps/s, from " in report, report
    assert all(p.poll() is None for p in job.procs), job.logs()  # the default policy reports and goes on
    stopped = time.monotonic()
    for proc in job.procs:
        proc.send_signal(signal.SIGINT)
    ends = job.finish(BOUND_S + 30)
    assert job.codes == [130, 130, 130], (job.codes, job.logs())
    assert max(ends) - stopped < 10.0, job.logs()
    print(f"gray link: reported {reported:.1f} s after shaping: {report}")
