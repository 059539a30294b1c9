"""Launching real processes: script mode, spawn/fork, `fabriclite run`, several nodes on this machine."""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import clean_env, free_port, json_lines, python, run, write_script

pytestmark = pytest.mark.slow

FACTS = """
    import json, os, sys
    from fabriclite import Fabric
    {setup}
    fabric.launch()
    fabric.barrier()
    sys.stdout.write("FACTS " + json.dumps(dict(
        world_size=fabric.world_size, global_rank=fabric.global_rank, local_rank=fabric.local_rank,
        node_rank=fabric.node_rank, num_nodes=fabric.num_nodes, is_global_zero=fabric.is_global_zero,
        device=str(fabric.device), env=type(fabric.strategy.cluster_environment).__name__,
        threads=__import__("torch").get_num_threads(), argv=sys.argv[1:])) + "\\n")
    sys.stdout.flush()  # one write per line: ranks share the pipe
"""


def expected(world: int, per_node: int, nodes: int):
    return sorted((r, r % per_node, r // per_node) for r in range(world))


@pytest.mark.parametrize("devices", [2, 4])
def test_script_mode_ranks(tmp_path, devices):
    script = write_script(tmp_path, FACTS.format(setup=f"fabric = Fabric(accelerator='cpu', devices={devices})"))
    result = python(script, "--lr", "0.1", timeout=90)
    assert result.returncode == 0, result.stderr
    facts = json_lines(result.stdout)
    assert sorted((f["global_rank"], f["local_rank"], f["node_rank"]) for f in facts) == expected(devices, devices, 1)
    assert all(f["world_size"] == devices and f["num_nodes"] == 1 and f["env"] == "FabricliteEnvironment"
               for f in facts)
    assert [f["is_global_zero"] for f in sorted(facts, key=lambda f: f["global_rank"])] == [True] + [False] * (devices - 1)
    assert all(f["argv"] == ["--lr", "0.1"] for f in facts)  # the script re-runs with its arguments
    assert all(f["threads"] == max(1, len(__import__("os").sched_getaffinity(0)) // devices) for f in facts)


def test_omp_num_threads_is_respected(tmp_path):
    script = write_script(tmp_path, FACTS.format(setup="fabric = Fabric(accelerator='cpu', devices=2)"))
    result = python(script, env={"OMP_NUM_THREADS": "2"})  # 2 cores // 2 ranks would give 1
    assert result.returncode == 0, result.stderr
    assert {f["threads"] for f in json_lines(result.stdout)} == {2}


SPAWN = """
    import os, sys
    from fabriclite import Fabric

    def work(fabric, base):
        fabric.barrier()
        return {{"rank": fabric.global_rank, "value": base + fabric.global_rank, "world": fabric.world_size,
                 "pid": os.getpid()}}

    if __name__ == "__main__":
        fabric = Fabric(accelerator="cpu", devices=3, strategy="{strategy}")
        result = fabric.launch(work, 40)
        assert result["pid"] != os.getpid(), result
        print("RESULT", result["rank"], result["value"], result["world"], flush=True)
"""


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_fork"])
def test_spawn_and_fork_return_rank_zeros_result(tmp_path, strategy):
    result = python(write_script(tmp_path, SPAWN.format(strategy=strategy)), timeout=90)
    assert result.returncode == 0, result.stderr
    assert "RESULT 0 40 3" in result.stdout


def test_two_nodes_with_the_cli(tmp_path):
    script = write_script(tmp_path, FACTS.format(setup="fabric = Fabric()"))
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, "-m", "fabriclite", "run", "--accelerator", "cpu", "--devices", "2",
                          "--num-nodes", "2", "--node-rank", str(node), "--main-address", "127.0.0.1",
                          "--main-port", port, str(script), "x"],
                         env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (1, 0)  # node 1 first: it must wait for node 0's store
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1] for o in outs]
    facts = json_lines("".join(o[0] for o in outs))
    assert sorted((f["global_rank"], f["local_rank"], f["node_rank"]) for f in facts) == expected(4, 2, 2)
    assert {(f["world_size"], f["num_nodes"], f["env"]) for f in facts} == {(4, 2, "FabricliteEnvironment")}


def test_two_nodes_with_node_rank_in_script_mode(tmp_path):
    script = write_script(tmp_path, FACTS.format(setup="fabric = Fabric(accelerator='cpu', devices=2, num_nodes=2)"))
    port = str(free_port())
    procs = [
        subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=clean_env({"NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}))
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1] for o in outs]
    facts = json_lines("".join(o[0] for o in outs))
    assert sorted((f["global_rank"], f["local_rank"], f["node_rank"]) for f in facts) == expected(4, 2, 2)


def test_cli_flags_conflicting_with_the_code(tmp_path):
    script = write_script(tmp_path, FACTS.format(setup="fabric = Fabric(accelerator='cpu', precision='64-true')"))
    result = run([sys.executable, "-m", "fabriclite", "run", "--accelerator", "cpu", "--devices", "2",
                  "--precision", "bf16-mixed", str(script)])
    assert result.returncode != 0
    assert "conflicts with `fabriclite run --precision bf16-mixed`" in result.stderr


def test_cli_rejects_bad_flags_before_starting(tmp_path):
    script = write_script(tmp_path, "raise SystemExit('must not run')\n")
    result = run([sys.executable, "-m", "fabriclite", "run", "--accelerator", "cpu", "--devices", "0", str(script)])
    assert result.returncode != 0 and "devices=0 must be a positive" in result.stderr
    assert "must not run" not in result.stderr
    result = run([sys.executable, "-m", "fabriclite", "run", "--num-nodes", "2", "--node-rank", "2", str(script)])
    assert result.returncode != 0 and "--node-rank 2 is out of range" in result.stderr
