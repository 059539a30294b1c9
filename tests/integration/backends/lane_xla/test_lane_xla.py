"""XLA lane: fabriclite's XLA accelerator, strategies and launcher on torch_xla 2.9.0's CPU client
(``PJRT_DEVICE=CPU``; torch 2.9.1; `make env-xla`). Each mode runs in a fresh process, since the XLA runtime fixes
its devices when it starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import checks  # noqa: E402
import job  # noqa: E402

JOB = job.__file__
FULL = [*checks.ALL, *job.XLA_CHECKS]
#: what torch_xla's spawn raises when a replica process ends abruptly (a crash in its runtime, no traceback)
RUNTIME_CRASH = "BrokenProcessPool: A process in the process pool was terminated abruptly"


def run_job(mode: str, out: str, devices: int) -> List[Dict[str, str]]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices),
           "FABRICLITE_EXPECT_WORLD": str(devices)}
    proc = subprocess.run([sys.executable, JOB, mode, out], capture_output=True, text=True, timeout=240, env=env)
    if proc.returncode != 0 and RUNTIME_CRASH in proc.stderr:
        # torch_xla's own replica process died without a Python traceback (seen 3 times in ~25 runs of the
        # threads mode, clustered in one minute of CI-like runs, never reproduced since): run the job once more,
        # saying so; a second crash, or any other failure, fails the test
        print(f"xla lane: {mode} job: torch_xla's replica process died ({RUNTIME_CRASH}); running it again once")
        proc = subprocess.run([sys.executable, JOB, mode, out], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(devices)]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, str]]:
    return run_job("single", str(tmp_path_factory.mktemp("single")), 1)


@pytest.fixture(scope="module")
def spawn(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, str]]:
    return run_job("spawn", str(tmp_path_factory.mktemp("spawn")), 1)


@pytest.fixture(scope="module")
def threads(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, str]]:
    return run_job("threads", str(tmp_path_factory.mktemp("threads")), 2)


def assert_ok(found: List[Dict[str, str]], name: str) -> None:
    for rank, res in enumerate(found):
        assert res.get(name) == "ok", f"rank {rank}, {name}:\n{res.get(name, 'not run')}"


@pytest.mark.parametrize("name", FULL)
def test_single_device_strategy(single: List[Dict[str, str]], name: str) -> None:
    assert_ok(single, name)


@pytest.mark.parametrize("name", FULL)
def test_xla_strategy_through_the_launcher_on_one_device(spawn: List[Dict[str, str]], name: str) -> None:
    """XLAStrategy and the launcher at world size 1: training_parity here checks the XLA step path (setup,
    xm.optimizer_step, MpDeviceLoader) against the one-process reference, not data parallelism."""
    assert_ok(spawn, name)


@pytest.mark.parametrize("name", job.THREADED)
def test_two_devices_in_one_process_without_training(threads: List[Dict[str, str]], name: str) -> None:
    """World size 2 (CPU_NUM_DEVICES=2): collectives, rank_zero_first, data sharding, save/load. Training, gradient
    accumulation and setup's parameter broadcast are not run at world size 2: torch_xla's CPU client aborts a graph
    holding two collectives across its device threads (job.THREADED says more; docs/backends.md). They run at world
    size 1 above, where training_parity compares one replica with the one-process reference."""
    assert_ok(threads, name)


def test_the_two_device_mode_leaves_out_only_what_the_cpu_client_cannot_run() -> None:
    left_out = set(FULL) - set(job.THREADED)
    assert left_out == {"training_parity", "accumulation_parity", "save_load", "xla_placement"}, left_out


def test_auto_never_picks_xla_on_a_cpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from fabriclite import Fabric

    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    assert Fabric().accelerator.name == "cpu"
    with pytest.raises(ValueError, match="PJRT_DEVICE=CPU"):
        Fabric(accelerator="tpu")


def test_devices_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    from fabriclite import Fabric

    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    for bad in (3, 0, "x", [5]):
        with pytest.raises((ValueError, TypeError), match="accelerator='tpu'"):
            Fabric(accelerator="tpu", devices=bad)
