"""Ray Train's recovery, failure -> training again (benchmarks/engines.py): the Ray lane's cluster on this machine
(``ray.cluster_utils.Cluster``, a head without CPUs and three 1-CPU nodes), docs/environments.md's TorchTrainer
recipe at 3 workers with ``FailureConfig``, the lane's training run (tests/support/engine_train.py, ddp); rank 1
SIGKILLs itself after step 12 and Ray restarts the worker group, which resumes from step 10.

Ray runs in the lane's own venv (scripts/engines/ray.sh): ``measure`` runs this file there (``--child``) and reads
the parts it prints. The cluster's start is not part of the recovery and is not counted.

Parts, from the run's own logs: the kill until the first new worker process started (Ray notices the dead actor,
stops the group, and starts new worker actors), the new workers' start until every rank had resumed (imports, Ray's
process group, ``fabric.launch()``, setup, ``load_latest``), then until every rank finished its first step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
LANE = ["bash", str(REPO / "scripts" / "engines" / "ray.sh")]


def available() -> Optional[str]:
    """None when the Ray lane's venv is built, else why not (one line)."""
    if subprocess.run(LANE + ["--check"]).returncode == 0:
        return None
    why = subprocess.run(LANE + ["--why"], capture_output=True, text=True).stdout.strip()
    return f"{why}; 'make env-engine-ray' builds it"


def measure(repeats: int) -> Dict[str, List[float]]:
    """The recovery's parts (seconds), one value per repeat (one cluster for all repeats)."""
    python = subprocess.run(LANE + ["--python"], capture_output=True, text=True, check=True).stdout.strip()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "support")])}
    done = subprocess.run([python, __file__, "--child", str(repeats)], env=env, capture_output=True, text=True,
                          timeout=600 + 300 * repeats)
    if done.returncode != 0:
        raise RuntimeError(f"the Ray recovery runs failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(repeats: int) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from engine_checks import read_attempts, recipe, recovery_parts, substitute

    store = 80 * 2 ** 20
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": store,
                                                            "include_dashboard": False})
    parts: Dict[str, List[float]] = {}
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=1, object_store_memory=store)
        ray.init(address=cluster.address, logging_level="WARNING")
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix="ray-recovery-") as folder:
                tmp = Path(folder)
                config = {"CKPT_DIR": str(tmp / "ckpt"), "LOG_DIR": str(tmp / "logs"), "KILL_AT": "12:1"}
                code = substitute(recipe("ray"), {
                    "import train  #": "import engine_train as train  #",
                    '{"CKPT_DIR": "/shared/ckpt"}': json.dumps(config), "num_workers=(2, 3)": "num_workers=3",
                    '"/shared/ray"': json.dumps(str(tmp / "ray")), "trainer.fit()": "result = trainer.fit()"})
                namespace: dict = {"__name__": "ray_recipe"}
                exec(compile(code, "docs/environments.md (recipe: ray)", "exec"), namespace)
                if namespace["result"].error is not None:
                    raise RuntimeError(f"the Ray run failed: {namespace['result'].error}")
                attempts = read_attempts(tmp / "logs")
                if len(attempts) != 2:
                    raise RuntimeError(f"expected 2 attempts, found {len(attempts)}")
                for name, value in recovery_parts(attempts).items():
                    parts.setdefault(name, []).append(value)
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(parts), flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    here = os.path.dirname(os.path.abspath(__file__))  # on sys.path as the script's folder: this file is not `ray`
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    _child(int(sys.argv[2]))
