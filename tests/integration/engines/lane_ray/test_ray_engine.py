"""Ray lane: fabriclite under Ray Train 2.60 (``TorchTrainer``), on a 3-node cluster on this machine
(``ray.cluster_utils.Cluster``: a head without CPUs for the driver and Ray Train's controller, and three nodes of one
CPU each, one worker each; object stores of 80 MiB, a test speed-up Ray allows). One cluster for the module: Ray's
start-up is slow on 2 cores. Each run is the recipe of docs/environments.md, read out of the doc (the tests substitute
the script's module, its settings, the shared folders and the worker count); the training run is
tests/support/engine_train.py. The checkpoints and Ray's storage are folders every worker shares.

- the loop unchanged at 3 workers: Fabric joins the process group Ray made (it exists before ``fabric.launch()``);
- a worker dies: ``FailureConfig`` restarts the group, which resumes bit-exact (ddp, 3 ranks) from the newest
  checkpoint the others wrote; ``fabric.restart_count`` stays 0 (Ray does not tell the workers);
- ``ScalingConfig(num_workers=(2, 3))`` with a node removed mid-run: Ray goes on with 2 workers, which resume
  elastically from a checkpoint written mid-epoch at 3.

All check the sample accounting (tests/support/engine_checks.py). Time: measured on the shared, loaded 2-core
machine, the cluster starts in 25-40 s and a run takes 60-150 s (most of it Ray starting its workers); each test
is bounded at 600 s by pytest-timeout.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from engine_checks import accounting, assert_bit_identical, assert_finite, read_attempts, recipe, substitute
from helpers import REPO

ray = pytest.importorskip("ray", reason="the Ray lane runs in its own venv: make env-engine-ray")
from ray.cluster_utils import Cluster  # noqa: E402

N, BATCH, STEPS = 50, 4, 30
OBJECT_STORE = 80 * 2 ** 20


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    support = str(REPO / "tests" / "support")
    # the nodes' worker processes import the training script and this checkout's fabriclite
    paths = [str(REPO), support] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": OBJECT_STORE,
                                                            "include_dashboard": False})
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE)
        ray.init(address=cluster.address, logging_level="WARNING")
        print(f"ray cluster of 3 nodes up in {time.monotonic() - started:.0f} s", file=sys.stderr)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def fit(tmp: Path, workers: str, **settings: str) -> Any:
    """Run the docs' TorchTrainer recipe with ``num_workers=<workers>``; returns its Result."""
    config = {"CKPT_DIR": str(tmp / "ckpt"), "LOG_DIR": str(tmp / "logs"), "OUT": str(tmp / "out.pt"), "N": str(N),
              "BATCH": str(BATCH), "STEPS": str(STEPS), **settings}
    code = substitute(recipe("ray"), {
        "import train  #": "import engine_train as train  #",
        '{"CKPT_DIR": "/shared/ckpt"}': json.dumps(config),
        "num_workers=(2, 3)": f"num_workers={workers}",
        '"/shared/ray"': json.dumps(str(tmp / "ray")),
        "trainer.fit()": "result = trainer.fit()"})
    namespace: Dict[str, Any] = {"__name__": "ray_recipe"}
    exec(compile(code, "docs/environments.md (recipe: ray)", "exec"), namespace)
    return namespace["result"]


@pytest.fixture(scope="module")
def uninterrupted(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The loop unchanged at 3 workers, nothing interrupting it (also the reference of the restart test)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    result = fit(tmp, "3")
    assert result.error is None, result.error
    return tmp


@pytest.mark.timeout(600)
def test_fabriclite_loop_unchanged_at_3_workers(uninterrupted: Path) -> None:
    attempts = read_attempts(uninterrupted / "logs")
    assert [(a.world, a.resumed_step) for a in attempts] == [(3, 0)]
    # Ray made the process group before the loop ran; Fabric used it rather than making another
    assert attempts[0].group_before_launch == {0: True, 1: True, 2: True}
    found = accounting(attempts, N, STEPS)
    assert found["kept"] == [(3, 1, STEPS)]
    assert_finite(uninterrupted / "out.pt")


@pytest.mark.timeout(600)
def test_worker_dies_failure_config_restarts_bit_exact(cluster: Cluster, uninterrupted: Path, tmp_path: Path) -> None:
    # rank 1 SIGKILLs itself after step 12: the newest checkpoint (in the shared folder) holds step 10
    result = fit(tmp_path, "3", KILL_AT="12:1")
    assert result.error is None, result.error
    attempts = read_attempts(tmp_path / "logs")
    assert [(a.world, a.resumed_step) for a in attempts] == [(3, 0), (3, 10)]
    assert attempts[0].killed == [12]
    # the shared folder: every new worker loaded the checkpoint the first group's rank 0 wrote there
    assert {h["resumed_from"] for h in attempts[1].heads.values()} == {"step-0010.ckpt"}
    found = accounting(attempts, N, STEPS)
    assert found["kept"] == [(3, 1, 10), (3, 11, STEPS)]  # the failed attempt's steps 11 and 12 do not count
    # Ray 2.60 tells the workers nothing of its restarts (docs/environments.md): restart_count stays 0
    assert attempts[1].restart_counts == {0: 0, 1: 0, 2: 0}
    assert_bit_identical(tmp_path / "out.pt", uninterrupted / "out.pt")


@pytest.mark.timeout(600)
def test_node_removed_ray_goes_on_with_2_workers_elastic_resume(cluster: Cluster, tmp_path: Path) -> None:
    # last in the module: it takes a node away. Checkpoints every 4 steps: at 3 workers an epoch is 5 steps, so
    # step 8 stops inside epoch 1 (36 of its 50 samples consumed); the 14 left do not divide by 2 x 4.
    import threading

    removed: List[str] = []
    errors: List[BaseException] = []

    def remove_a_node_at_step_9() -> None:
        try:
            deadline = time.monotonic() + 400
            while time.monotonic() < deadline:
                node = _node_of_a_worker(cluster, tmp_path / "logs", after_step=9)
                if node is not None:
                    removed.append(node.unique_id)
                    cluster.remove_node(node, allow_graceful=False)
                    return
                time.sleep(0.2)
        except BaseException as err:  # noqa: BLE001  reported by the test
            errors.append(err)

    remover = threading.Thread(target=remove_a_node_at_step_9, daemon=True)
    remover.start()
    result = fit(tmp_path, "(2, 3)", SAVE_EVERY="4", SLEEP="0.15")
    remover.join(timeout=5)
    assert not errors, errors
    assert removed, "the run ended before a node could be removed at step 9"
    assert result.error is None, result.error
    attempts = read_attempts(tmp_path / "logs")
    assert attempts[0].world == 3 and attempts[-1].world == 2, [(a.world, a.resumed_step) for a in attempts]
    assert attempts[-1].resumed_step >= 8 and attempts[-1].resumed_step % 4 == 0
    found = accounting(attempts, N, STEPS)
    assert 2 in found["worlds"][max(found["worlds"])]
    assert_finite(tmp_path / "out.pt")


def _node_of_a_worker(cluster: Cluster, logs: Path, after_step: int) -> Optional[Any]:
    """The worker node (not the head) whose raylet started the rank-2 worker of the first attempt, once that
    attempt has logged ``after_step`` on every rank; else None."""
    heads = []
    for path in logs.glob("log-*.jsonl") if logs.exists() else []:
        lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
        if not lines or max(json.loads(line).get("step", 0) for line in lines) < after_step:
            return None
        heads.append(json.loads(lines[0]))
    if len(heads) < 3:
        return None
    raylets = {node.all_processes["raylet"][0].process.pid: node for node in cluster.worker_nodes}
    for head in sorted(heads, key=lambda h: -h["rank"]):
        pid = head["pid"]
        while pid > 1:
            if pid in raylets:
                return raylets[pid]
            try:
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                break
    return None
