"""A real torchrun: its ranks see the TorchElasticEnvironment with torchrun's ranks, address and port."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

_TORCHRUN_SCRIPT = """
import json, os, sys
from fabriclite.environments import detect_environment
env = detect_environment()
with open(os.path.join(sys.argv[1], "rank%s.json" % os.environ["RANK"]), "w") as out:
    json.dump({
        "cls": type(env).__name__, "world": env.world_size(), "rank": env.global_rank(), "local": env.local_rank(),
        "node": env.node_rank(), "local_world": env.local_world_size(), "nodes": env.num_nodes(),
        "addr": env.main_address, "port": env.main_port, "agent_store": env.uses_agent_store,
        "agent_store_var": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
    }, out)
"""


@pytest.mark.slow
def test_real_torchrun_is_detected(tmp_path: Path) -> None:
    script = tmp_path / "write_env.py"
    script.write_text(_TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", str(script),
         str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [(r["rank"], r["local"]) for r in rows] == [(0, 0), (1, 1)], out.stdout + out.stderr
    for row in rows:
        assert row["cls"] == "TorchElasticEnvironment"
        assert (row["world"], row["node"], row["local_world"], row["nodes"]) == (2, 0, 2, 1)
        assert row["addr"] and 0 < row["port"] < 65536
        assert row["agent_store"] == (row["agent_store_var"] == "True")
    assert rows[0]["port"] == rows[1]["port"]
