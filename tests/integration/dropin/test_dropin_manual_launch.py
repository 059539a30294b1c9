"""Real ranks started by hand (Lightning's manual launch: LOCAL_RANK, NODE_RANK, WORLD_SIZE, MASTER_ADDR /
MASTER_PORT per process), the same script under Lightning Fabric and under fabriclite (manual_launch_job.py):

- issue 21 item 8: ``launch()`` joins the hand-started ranks and starts nothing (two processes, two results, the
  pids of the processes started here), with Lightning's ranks;
- item 4: ``rank_zero_only`` / ``rank_zero_warn`` / ``rank_zero_info`` from ``utilities.rank_zero`` work before
  ``launch()`` in a fresh process, with the rank the environment gives (LOCAL_RANK);
- item 1: a method that runs the network outside ``forward`` raises Lightning's RuntimeError naming
  ``mark_forward_method``; once marked, DDP synchronises it (the ranks' weights agree);
- a ``torch.compile``d module is set up under DDP and compiled again around the DDP wrapper.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from helpers import clean_env, json_lines

JOB = str(Path(__file__).resolve().parent / "manual_launch_job.py")
#: two ranks per framework, both frameworks at once: measured 27 s at a load average of 14-16 on 2 cores (importing
#: torch and the framework dominates); 240 s leaves a margin of about 9x
TIMEOUT = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(framework: str) -> List[subprocess.Popen]:
    port = str(_free_port())
    procs = []
    for local_rank in (0, 1):
        env = clean_env({"DROPIN_FABRIC": framework, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                         "NODE_RANK": "0", "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
                         "FABRICLITE_TIMEOUT": "120"})
        procs.append(subprocess.Popen([sys.executable, JOB], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return procs


@pytest.fixture(scope="module")
def facts() -> Dict[str, List[dict]]:
    """``{framework: [rank 0's facts, rank 1's facts]}`` (each fact dict has the pid of the process started)."""
    started = {framework: _start(framework) for framework in ("lightning.fabric", "fabriclite")}
    deadline = time.monotonic() + TIMEOUT
    out: Dict[str, List[dict]] = {}
    try:
        for framework, procs in started.items():
            lines = []
            for proc in procs:
                text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                assert proc.returncode == 0, f"{framework} rank exited {proc.returncode}:\n{text}"
                found = json_lines(text)
                assert len(found) == 1, f"{framework}: one FACTS line per process expected:\n{text}"
                assert found[0]["pid"] == proc.pid, "the result came from another process: something launched"
                lines += found
            out[framework] = lines
    finally:
        for procs in started.values():
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
    return out


def _without_pid(rank_facts: dict) -> dict:
    return {k: v for k, v in rank_facts.items() if k != "pid"}


def test_the_same_facts_under_both(facts):
    assert [_without_pid(f) for f in facts["fabriclite"]] == [_without_pid(f) for f in facts["lightning.fabric"]]


def test_hand_started_ranks_join_with_lightnings_ranks(facts):
    ours = facts["fabriclite"]
    assert [f["ranks"] for f in ours] == [[2, 0, 0, 0], [2, 1, 1, 0]]
    assert [f["sum"] for f in ours] == [3.0, 3.0]


def test_rank_zero_functions_before_launch_use_the_environments_rank(facts):
    zero, one = facts["fabriclite"]
    assert (zero["rank_zero_only"], zero["rank_zero_only.rank"], zero["warned"], zero["logged"]) == \
        ("ran", 0, ["warned before launch"], ["logged before launch"])
    assert (one["rank_zero_only"], one["rank_zero_only.rank"], one["warned"], one["logged"]) == (None, 1, [], [])


def test_a_method_bypassing_ddp_is_refused_until_marked(facts):
    zero, one = facts["fabriclite"]
    assert zero["unmarked"] == one["unmarked"] == ["RuntimeError", True]
    assert zero["describe"] == "a method that runs no submodule"  # methods that run no submodule pass
    assert zero["weights"] == one["weights"]  # marked: DDP averaged the gradients of different data


def test_a_compiled_module_is_compiled_again_around_ddp(facts):
    zero, one = facts["fabriclite"]
    assert zero["compiled"][:4] == ["OptimizedModule", "DistributedDataParallel", True,
                                    ["layer.bias", "layer.weight"]]
    assert zero["compiled"] == one["compiled"]
