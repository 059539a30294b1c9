"""Harness for live recovery (``fabriclite run --fault-tolerant``): start N local nodes, each its own
``fabriclite run`` process (node 0's supervisor hosts the lighthouse), on the ft lane's script
(tests/integration/backends/lane_ft/ft_train.py), and read back each group's step log. Used by the ft lane's
tests and by benchmarks/fault_tolerance.py."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from helpers import REPO, clean_env, free_port  # noqa: F401 (free_port: the lane's tests take it from here)

TRAIN = REPO / "tests" / "integration" / "backends" / "lane_ft" / "ft_train.py"
#: every node started by this process and not yet reaped: ``stop_left()`` ends them after each test
#: (tests/integration/backends/lane_ft/conftest.py), so a test stopped by pytest-timeout or a failed assertion
#: leaves no job running on into the next test
_UNREAPED: List["Node"] = []


@dataclass
class Node:
    rank: int
    process: subprocess.Popen
    log_path: Path
    output: str = ""

    @property
    def code(self) -> Optional[int]:
        return self.process.returncode


def start_nodes(out: Path, steps: int, nodes: int = 3, args: Sequence[str] = (), env: Optional[Dict[str, str]] = None,
                port: Optional[int] = None, ranks: Optional[Sequence[int]] = None, script: Path = TRAIN,
                python: str = sys.executable, fault_tolerant: bool = True,
                spawn: Optional[Callable[..., subprocess.Popen]] = None) -> List[Node]:
    """Start ``fabriclite run --fault-tolerant --num-nodes N --node-rank i`` for each ``i`` in ``ranks`` (default
    all), the script writing under ``out``. Output goes to ``out/node<i>.log``. ``fault_tolerant=False``: the same
    nodes as one plain ddp job (one rank each). ``spawn(rank, command, env, **popen_kwargs)`` starts a node's
    command elsewhere (a network namespace: tests/integration/netns/cluster.py) instead of here."""
    out.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    started = []
    for rank in (range(nodes) if ranks is None else ranks):
        log_path = out / f"node{rank}.log"
        mode = ["--fault-tolerant"] if fault_tolerant else ["--accelerator", "cpu", "--devices", "1"]
        command = [python, "-m", "fabriclite.cli", "run", *mode, "--num-nodes", str(nodes),
                   "--node-rank", str(rank), "--main-port", str(port), *args, str(script), str(out), str(steps)]
        kwargs = dict(stdout=open(log_path, "w"), stderr=subprocess.STDOUT, cwd=str(out))
        full_env = clean_env({"PYTHONPATH": str(REPO), **(env or {})})
        process = spawn(rank, command, full_env, **kwargs) if spawn else subprocess.Popen(command, env=full_env,
                                                                                             **kwargs)
        started.append(Node(rank, process, log_path))
    _UNREAPED.extend(started)
    return started


def _reap(nodes: List[Node], deadline: float) -> None:
    """Wait for each node until ``deadline`` (time.monotonic()), then SIGKILL what is left."""
    for node in nodes:
        try:
            node.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.process.kill()
            node.process.wait()


def stop_left(grace_s: float = 10.0) -> List[int]:
    """End every node this process started that still runs: SIGTERM (the supervisor stops its ranks), SIGKILL
    after ``grace_s``. Returns the node ranks that were still running."""
    running = [node for node in _UNREAPED if node.process.poll() is None]
    for node in running:
        node.process.terminate()
    _reap(running, time.monotonic() + grace_s)
    _UNREAPED.clear()
    return [node.rank for node in running]


def wait_nodes(nodes: List[Node], timeout: float) -> List[Node]:
    """Wait for every node (killing what is left after ``timeout`` s); read their outputs."""
    _reap(nodes, time.monotonic() + timeout)
    for node in nodes:
        node.output = node.log_path.read_text(errors="replace")
    return nodes


@dataclass
class StepLog:
    """One group's ``steps-<group>.txt``: ``starts`` (round, step after load_latest, time, source), ``processes``
    (round, the process's start time), ``saves`` (step, time) and ``rows`` (step after the iteration, time,
    committed)."""

    starts: List[tuple] = field(default_factory=list)
    rows: List[tuple] = field(default_factory=list)
    end: Optional[tuple] = None
    processes: List[tuple] = field(default_factory=list)
    saves: List[tuple] = field(default_factory=list)

    @classmethod
    def read(cls, out: Path, group: int) -> "StepLog":
        log = cls()
        for line in (out / f"steps-{group}.txt").read_text().splitlines():
            parts = line.split(maxsplit=4)
            if parts[0] == "start":
                log.starts.append((int(parts[1]), int(parts[2]), float(parts[3]), parts[4]))
            elif parts[0] == "saved":
                log.saves.append((int(parts[1]), float(parts[2])))
            elif parts[0] == "process":
                log.processes.append((int(parts[1]), float(parts[2])))
            elif parts[0] == "end":
                log.end = (int(parts[1]), float(parts[2]))
            else:
                log.rows.append((int(parts[0]), float(parts[1]), int(parts[2])))
        return log

    def committed_times(self) -> List[float]:
        return [t for _, t, ok in self.rows if ok]

    def longest_gap(self, after: float = 0.0) -> float:
        """The longest time between two committed steps (after time ``after``)."""
        times = [t for t in self.committed_times() if t >= after]
        return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def final_weights(out: Path, group: int) -> Dict[str, "object"]:
    import torch

    return torch.load(out / f"final-{group}.pt")


def python_of_ft_lane() -> str:
    """The ft lane's interpreter (scripts/backend_env.sh ft --path), or this one if it has torchft."""
    env = subprocess.run(["bash", str(REPO / "scripts" / "backend_env.sh"), "ft", "--path"], capture_output=True,
                         text=True).stdout.strip()
    candidate = os.path.join(env, "bin", "python")
    return candidate if os.path.exists(candidate) else sys.executable
