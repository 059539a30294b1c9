"""torchrun lane: fabriclite under torch's own elastic agent (torchrun, c10d rendezvous), three agents on this
machine with one worker each, started by the recipe of docs/environments.md (read out of the doc: the tests
substitute the interpreter, the script, the port and the checkpoint folder, and add short rendezvous timeouts
through ``--rdzv-conf``, a test speed-up torchrun allows). The training run is tests/support/engine_train.py.

- a worker crash: torchrun restarts every worker; the job resumes from the newest checkpoint and ends with the
  uninterrupted run's weights, bit for bit (ddp, 3 ranks); ``fabric.restart_count`` is 1 on every rank;
- an agent that does not host the rendezvous (nor the workers' store: rendezvous rank 0) is SIGKILLed with its
  worker: the two others meet again at world size 2 and resume from a checkpoint written mid-epoch at 3 (elastic
  resume) and finish.

Both check the sample accounting (tests/support/engine_checks.py). Time bounds (measured on the shared 2-core
machine with other test runs: an uninterrupted 3-rank run 20 s, a run with one restart 25-40 s): each job gets
240 s, ~5x.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from engine_checks import (ENGINE_TRAIN, accounting, assert_bit_identical, assert_finite, kill_tree, read_attempts,
                           torchrun_agents)
from helpers import REPO, clean_env, free_port

SCRIPT = ENGINE_TRAIN
N, BATCH, STEPS = 50, 4, 30
JOB_TIMEOUT_S = 240


def _env(tmp: Path, **extra: str) -> Dict[str, str]:
    return clean_env({"PYTHONPATH": str(REPO), "LOG_DIR": str(tmp / "logs"), "OUT": str(tmp / "out.pt"),
                      "N": str(N), "BATCH": str(BATCH), "STEPS": str(STEPS), "JOB_ID": f"job-{tmp.name}",
                      "HEAD_NODE": "127.0.0.1", **extra})


_started: List[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_agent_left() -> Iterator[None]:
    """Every agent a test started, and its workers, are gone after it, however it ended."""
    yield
    while _started:
        kill_tree(_started.pop().pid)


def _agents(tmp: Path, env: Dict[str, str], count: int = 3) -> List[subprocess.Popen]:
    agents = torchrun_agents(tmp, env, free_port(), count)
    _started.extend(agents)
    return agents


def _wait(agents: List[subprocess.Popen], tmp: Path, timeout: float = JOB_TIMEOUT_S) -> List[int]:
    deadline = time.monotonic() + timeout
    try:
        return [a.wait(timeout=max(1.0, deadline - time.monotonic())) for a in agents]
    except subprocess.TimeoutExpired:
        for a in agents:
            kill_tree(a.pid)
        pytest.fail(f"the torchrun job did not end within {timeout:.0f} s\n{_logs(tmp)}")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-4000:]}" for p in sorted(tmp.glob("agent*.log")))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same job at 3 ranks that nothing interrupts (one agent, ``--standalone``)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    env = _env(tmp, CKPT_DIR=str(tmp / "ckpt"))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           str(SCRIPT)], env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    accounting(read_attempts(tmp / "logs"), N, STEPS)
    return tmp / "out.pt"


def test_worker_crash_restarts_every_worker_and_resumes_bit_exact(tmp_path: Path, uninterrupted: Path) -> None:
    # rank 1 SIGKILLs itself after step 12; the newest checkpoint then holds step 10
    agents = _agents(tmp_path, _env(tmp_path, KILL_AT="12:1", SAVE_EVERY="5"))
    codes = _wait(agents, tmp_path)
    assert codes == [0, 0, 0], f"agents exited {codes}\n{_logs(tmp_path)}"
    attempts = read_attempts(tmp_path / "logs")
    assert [(a.world, a.resumed_step) for a in attempts] == [(3, 0), (3, 10)], _logs(tmp_path)
    assert attempts[0].killed == [12]
    found = accounting(attempts, N, STEPS)
    assert found["kept"] == [(3, 1, 10), (3, 11, 30)]  # the failed attempt's steps 11 and 12 do not count
    # torchrun restarted the job once: every rank says so, whichever agent noticed the failure first
    assert attempts[1].restart_counts == {0: 1, 1: 1, 2: 1}, attempts[1].restart_counts
    assert attempts[0].restart_counts == {0: 0, 1: 0, 2: 0}
    assert_bit_identical(tmp_path / "out.pt", uninterrupted)


def test_killed_agent_the_others_go_on_at_world_size_2(tmp_path: Path) -> None:
    # checkpoints every 4 steps: at 3 ranks an epoch is 5 steps (17 samples a rank), so step 8 stops inside epoch 1 (36 of 50 samples consumed);
    # at 2 ranks the 14 left do not divide by 2 x 4
    agents = _agents(tmp_path, _env(tmp_path, SAVE_EVERY="4", SLEEP="0.15"))
    logs = tmp_path / "logs"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    victim = None
    while victim is None:
        assert time.monotonic() < deadline, f"the job never reached step 9\n{_logs(tmp_path)}"
        assert all(a.poll() is None for a in agents), f"an agent ended early\n{_logs(tmp_path)}"
        time.sleep(0.2)
        victim = _victim(logs, agents, after_step=9)
    agent, worker = victim
    _kill_group(agent.pid)  # the agent first: it must not see its worker die and start another
    os.kill(worker, signal.SIGKILL)
    survivors = [a for a in agents if a is not agent]
    codes = _wait(survivors, tmp_path)
    assert codes == [0, 0], f"the surviving agents exited {codes}\n{_logs(tmp_path)}"
    attempts = read_attempts(logs)
    assert attempts[0].world == 3 and attempts[-1].world == 2, [(a.world, a.resumed_step) for a in attempts]
    assert attempts[-1].resumed_step % 4 == 0 and attempts[-1].resumed_step >= 8
    found = accounting(attempts, N, STEPS)
    assert 2 in found["worlds"][max(found["worlds"])]
    assert_finite(tmp_path / "out.pt")


def _victim(logs: Path, agents: List[subprocess.Popen], after_step: int):
    """(agent, its worker's pid) of a worker that is not rank 0 and whose agent is not agent 0 (the rendezvous
    host), once the first attempt has logged ``after_step``; else None."""
    heads = []
    for path in logs.glob("log-*.jsonl") if logs.exists() else []:
        lines = path.read_text().splitlines()
        if not lines:
            return None
        steps = [json.loads(line).get("step", 0) for line in lines[1:] if line.endswith("}")]
        if not steps or max(steps) < after_step:
            return None
        heads.append(json.loads(lines[0]))
    if len(heads) < 3:
        return None
    parents = {a.pid: a for a in agents}
    for head in sorted(heads, key=lambda h: -h["rank"]):
        if head["rank"] == 0:
            continue
        agent = parents.get(_agent_of(head["pid"], set(parents)))
        if agent is not None and agent is not agents[0]:
            return agent, head["pid"]
    return None


def _agent_of(pid: int, roots: set) -> int:
    """The process among ``roots`` that ``pid`` descends from (walking /proc's parents), else -1."""
    while pid > 1:
        if pid in roots:
            return pid
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return -1
    return -1
