"""torchrun's recovery, failure -> training again (benchmarks/engines.py): three agents on this machine started by
docs/environments.md's recipe (tests/support/engine_checks.torchrun_agents, the torchrun lane's short rendezvous
timeouts), the lane's training run (tests/support/engine_train.py, 3 ranks, ddp); rank 1 SIGKILLs itself after
step 12 and torchrun restarts every worker, which resume from step 10.

Parts, from the run's own logs: the kill until the first new worker process started (the agents notice, stop the
others' workers and meet again in the rendezvous, ``last_call_timeout=2`` included), the new workers' start until
every rank had resumed (imports, ``fabric.launch()``, setup, ``load_latest``), then until every rank finished its
first step."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "support"))

JOB_TIMEOUT_S = 300


def available() -> Optional[str]:
    """None when torchrun can run here (it comes with torch), else why not."""
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError as err:
        return f"torchrun cannot be imported: {err}"
    return None


def measure(repeats: int) -> Dict[str, List[float]]:
    """The recovery's parts (seconds), one value per repeat."""
    from engine_checks import kill_tree, read_attempts, recovery_parts, torchrun_agents
    from helpers import clean_env, free_port

    parts: Dict[str, List[float]] = {}
    for repeat in range(repeats):
        with tempfile.TemporaryDirectory(prefix="torchrun-recovery-") as folder:
            tmp = Path(folder)
            env = clean_env({"PYTHONPATH": str(REPO), "LOG_DIR": str(tmp / "logs"), "OUT": str(tmp / "out.pt"),
                             "KILL_AT": "12:1", "SAVE_EVERY": "5", "JOB_ID": f"bench-{os.getpid()}-{repeat}",
                             "HEAD_NODE": "127.0.0.1"})
            agents = torchrun_agents(tmp, env, free_port())
            try:
                codes = [agent.wait(timeout=JOB_TIMEOUT_S) for agent in agents]
            finally:
                for agent in agents:
                    kill_tree(agent.pid)
            if codes != [0, 0, 0]:
                raise RuntimeError(f"the torchrun job failed ({codes}): {(tmp / 'agent0.log').read_text()[-2000:]}")
            attempts = read_attempts(tmp / "logs")
            if len(attempts) != 2:
                raise RuntimeError(f"expected 2 attempts, found {len(attempts)}")
            for name, value in recovery_parts(attempts).items():
                parts.setdefault(name, []).append(value)
    return parts
