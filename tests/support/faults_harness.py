"""The harness of the fault tests: a script whose ranks fail on demand (FAULT_SCRIPT), jobs that run it
as real processes and read their output as it comes (Job, run_jobs), and the checks every fault test makes
(non-zero exit, ended within a bound, nothing of the job left: assert_failed_fast, assert_nothing_left).

The ranks print ``FAULT {json}`` lines: their pids and process groups (and their helper children's), to
check that nothing is left, and the time just before the fault, to measure how fast the job ends.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

#: how long after the fault a job may take to end. Detection is ~0.1 s; ending the ranks and the supervisor (the
#: interpreters' teardown of torch) took 0.6-1.5 s at load 20, and up to MEASURED_END_S there with two more busy
#: processes (the worst seen). The bound is that worst case with a margin of MARGIN (2x): jobs that wait for a
#: timeout instead would take 30 min (the default), so the bound still tells them apart
MEASURED_END_S = 13.7
MARGIN = 2.0
END_BOUND_S = MEASURED_END_S * MARGIN
FAULT_SCRIPT = r'''
import json, os, signal, subprocess, sys, time

FAULT = os.environ.get("FAULT", "none")
MODE = os.environ.get("MODE", "script")


def say(**record):  # one write: lines of several processes share the pipe
    os.write(1, ("FAULT " + json.dumps(record) + "\n").encode())


def work(fabric):
    rank = fabric.global_rank
    say(rank=rank, pid=os.getpid(), pgid=os.getpgid(0))
    fabric.barrier()  # everyone is up
    if FAULT == "raise" and rank == int(os.environ.get("FAIL_RANK", "1")):
        say(fault_at=time.time())
        raise ValueError(f"rank {rank} fails on purpose")
    if FAULT == "kill1" and rank == 1:
        say(fault_at=time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "exit1" and rank == 1:
        say(fault_at=time.time())
        sys.exit(3)
    if FAULT == "kill0" and rank == 0:
        say(fault_at=time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    if FAULT == "raise0_busy":
        if rank == 0:
            time.sleep(0.5)
            say(fault_at=time.time())
            raise RuntimeError("rank 0 fails on purpose")
        helper = subprocess.Popen(["sleep", "300"])  # a grandchild in the rank's process group
        say(rank=rank, helper=helper.pid)
        while True:  # busy, no collectives
            sum(range(1000))
    if FAULT == "sleep1" and rank == 1:
        say(fault_at=time.time())
        time.sleep(10_000)
    if FAULT == "wait":  # for signals to the supervisor: every rank idles, one with a helper child
        helper = subprocess.Popen(["sleep", "300"])
        say(rank=rank, helper=helper.pid, ready=True)
        time.sleep(10_000)
    fabric.barrier()
    if FAULT == "late":  # no fault: node 1 ends only once node 0's rank has ended (an event, not a sleep)
        pids = fabric.strategy.all_gather_object(os.getpid())
        if fabric.node_rank == 1:
            deadline = time.time() + 120
            while time.time() < deadline:
                try:
                    os.kill(pids[0], 0)
                except ProcessLookupError:
                    say(rank=rank, node0_rank_gone=True)
                    break
                time.sleep(0.01)
    say(rank=rank, done=True, at=time.time())
    return rank


if __name__ == "__main__":
    from fabriclite import Fabric

    strategy = {"script": "ddp", "spawn": "ddp_spawn", "fork": "ddp_fork"}[MODE]
    leader = {"pgid": os.getpid()} if os.getpgid(0) == os.getpid() else {}  # a rank under the CLI
    say(before_launch=time.time(), pid=os.getpid(), **leader)  # under the CLI, Fabric() joins the job
    if os.environ.get("UNDER_CLI"):
        fabric = Fabric()
    else:
        fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("DEVICES", "2")), strategy=strategy)
    if MODE == "script":
        fabric.launch()
        work(fabric)
    else:
        fabric.launch(work)
'''


@dataclass
class Job:
    """A supervisor process (and its ranks) started from ``args``; its output is read as it comes."""

    name: str
    args: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    #: called (once) with the job when every rank printed its pid and ``ready`` records expected
    on_ready: Optional[Callable[["Job"], None]] = None
    ready_ranks: int = 0
    timeout: float = 120.0
    proc: Optional[subprocess.Popen] = None
    out: List[str] = field(default_factory=list)
    err: List[str] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    returncode: Optional[int] = None
    extra: Dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        self.started = time.time()
        self.proc = subprocess.Popen(self.args, env=clean_env(self.env), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, errors="replace")
        self._threads = [threading.Thread(target=self._read, args=(s, sink), daemon=True)
                         for s, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._threads:
            t.start()
        self._fired = False

    def _read(self, stream, sink: List[str]) -> None:  # type: ignore[no-untyped-def]
        for line in stream:
            sink.append(line)

    def poll(self) -> bool:
        """Advance: fire ``on_ready`` when due; True once the supervisor has exited."""
        assert self.proc is not None
        if self.returncode is None:
            code = self.proc.poll()
            if code is not None:
                self.returncode, self.ended = code, time.time()
                for t in self._threads:
                    t.join(timeout=5)
            elif time.time() - self.started > self.timeout:
                kill_tree(self)
                raise AssertionError(f"job {self.name} did not end within {self.timeout} s:\n{self.output}")
        if not self._fired and self.on_ready is not None and len(self.ready()) >= self.ready_ranks:
            self._fired = True
            self.on_ready(self)
        return self.returncode is not None

    # ------------------------------------------------------------------ what the ranks said
    @property
    def records(self) -> List[dict]:
        return [json.loads(m.group(1)) for line in list(self.out)
                for m in re.finditer(r"FAULT (\{[^{}]*\})", line)]

    @property
    def ranks(self) -> List[dict]:
        """The records of ranks that reached ``work``."""
        return [r for r in self.records if "rank" in r and "pid" in r]

    def ready(self) -> List[dict]:
        return [r for r in self.records if r.get("ready")]

    @property
    def pids(self) -> List[int]:
        """Every rank's and helper's pid (the ranks' pids are also their process groups)."""
        return [r[k] for r in self.records for k in ("pid", "helper") if k in r]

    @property
    def groups(self) -> List[int]:
        return [r["pgid"] for r in self.records if "pgid" in r]

    @property
    def cli_ready_at(self) -> float:
        """When the CLI's imports were done (see ``cli_job``)."""
        times = [r["cli_ready_at"] for r in self.records if "cli_ready_at" in r]
        assert times, f"job {self.name}: the CLI never said it was ready:\n{self.output}"
        return times[0]

    @property
    def fault_at(self) -> float:
        times = [r["fault_at"] for r in self.records if "fault_at" in r]
        assert times, f"job {self.name}: no rank reported its fault:\n{self.output}"
        return min(times)

    def summary_line(self) -> str:
        """"name: exit N, X s after the fault (or signal), Y s in all", for the run's log."""
        marks = [r["fault_at"] for r in self.records if "fault_at" in r] + list(self.extra.values())
        after = f", {self.ended - min(marks):.2f} s after the fault" if marks else ""
        return f"{self.name}: exit {self.returncode}{after}, {self.ended - self.started:.1f} s in all"

    @property
    def output(self) -> str:
        return "".join(self.out) + "\n--- stderr ---\n" + "".join(self.err)


def clean_env(extra: Dict[str, str]) -> Dict[str, str]:
    """This environment without cluster variables (so nothing leaks in from an outer launcher)."""
    cluster = re.compile(r"^(SLURM_|OMPI_|PMI_|PMIX_|MV2_|LSB_|JSM_|TORCHELASTIC_|FABRICLITE_(?!JOB_SECRET_FILE$)|MASTER_ADDR$|"
                         r"MASTER_PORT$|RANK$|WORLD_SIZE$|LOCAL_RANK$|LOCAL_WORLD_SIZE$|NODE_RANK$|GROUP_RANK$)")
    env = {k: v for k, v in os.environ.items() if not cluster.match(k)}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def run_jobs(jobs: Iterable[Job], at_once: int = 3) -> None:
    """Run ``jobs``, at most ``at_once`` at a time, until every one has ended."""
    waiting, running = list(jobs), []  # type: ignore[var-annotated]
    while waiting or running:
        while waiting and len(running) < at_once:
            job = waiting.pop(0)
            job.start()
            running.append(job)
        running = [j for j in running if not j.poll()]
        time.sleep(0.02)


def kill_tree(job: Job) -> None:
    """Clean up after a failed test: kill the supervisor and every process of the job."""
    if job.proc is not None and job.proc.poll() is None:
        job.proc.kill()
    for pid in set(job.groups):
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    for pid in job.pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def living(pids: Iterable[int] = (), groups: Iterable[int] = ()) -> List[str]:
    """Processes (not zombies) among ``pids`` or in the process ``groups``, as 'pid (cmdline)'."""
    pids, groups = set(pids), set(groups)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_text().replace("\0", " ").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        state, pgid = fields[0], int(fields[2])
        if state in ("Z", "X"):
            continue
        if int(entry) in pids or pgid in groups:
            found.append(f"{entry} ({cmdline[:80]})")
    return found


def assert_nothing_left(job: Job, within: float = 5.0) -> None:
    """No rank, helper child or member of a rank's process group is alive (waits up to ``within``)."""
    assert job.pids, f"job {job.name}: the ranks printed no pids:\n{job.output}"
    deadline = time.time() + within
    while (left := living(job.pids + [job.proc.pid], job.groups)) and time.time() < deadline:  # type: ignore[union-attr]
        time.sleep(0.05)
    if left:
        kill_tree(job)
    assert not left, f"job {job.name}: processes left after the job ended: {left}\n{job.output}"


def assert_failed_fast(job: Job, bound: float = END_BOUND_S) -> float:
    """The job exited non-zero within ``bound`` seconds of the first fault, its ranks ended on
    SIGTERM (no wait for the grace period); returns how long it took."""
    assert job.returncode not in (0, None), f"job {job.name} exited {job.returncode}:\n{job.output}"
    assert "of SIGTERM and were killed" not in "".join(job.err), job.output
    took = job.ended - job.fault_at
    assert took < bound, f"job {job.name} took {took:.1f} s after the fault to end:\n{job.output}"
    return took


def script_job(tmp: Path, name: str, fault: str, mode: str = "script", env: Optional[Dict[str, str]] = None,
               **kwargs) -> Job:  # type: ignore[no-untyped-def]
    script = tmp / "fault_script.py"
    if not script.exists():
        script.write_text(textwrap.dedent(FAULT_SCRIPT))
    return Job(name, [sys.executable, str(script)], {"FAULT": fault, "MODE": mode, **(env or {})}, **kwargs)


#: ``python -m fabriclite`` that first says when its imports are done (``cli_ready_at``): bounds on how fast the CLI
#: ends are measured from there, since starting Python and importing torch take 2 s on a quiet machine and 30 s
#: on a loaded one
CLI_PRELUDE = ("import json, os, time\n"
               "from fabriclite import cli\n"
               "os.write(1, ('FAULT ' + json.dumps({'cli_ready_at': time.time()}) + '\\n').encode())\n"
               "cli.main()\n")


def cli_job(tmp: Path, name: str, fault: str, cli_args: Sequence[str], env: Optional[Dict[str, str]] = None,
            **kwargs) -> Job:  # type: ignore[no-untyped-def]
    job = script_job(tmp, name, fault, env={"UNDER_CLI": "1", **(env or {})}, **kwargs)
    job.args = [sys.executable, "-c", CLI_PRELUDE, "run", *cli_args, job.args[1]]
    return job


def send(sig: int) -> Callable[[Job], None]:
    def action(job: Job) -> None:
        job.extra["signal_at"] = time.time()
        assert job.proc is not None
        job.proc.send_signal(sig)

    return action
