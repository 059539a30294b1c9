"""ft lane: the folder fabriclite/strategies/torchft/ never stands for the torchft package. With the real torchft
installed, its modules' ``import torchft...`` get the real package (their imports are absolute), and only
``replica_parts`` and ``diloco_sync`` import it: the strategies and their settings load without it. Each check
runs in a fresh interpreter, so what is imported is what the check imports."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import fabriclite

FOLDER = Path(fabriclite.__file__).parent / "strategies" / "torchft"


def run(code: str) -> Any:
    """What ``code`` prints (one JSON value), run by this lane's interpreter."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_folder_imports_the_real_torchft() -> None:
    found = run("import json\n"
                "from fabriclite.strategies.torchft import diloco_sync, replica_parts\n"
                "import torchft, torchft.local_sgd, torchft.manager\n"
                "print(json.dumps([torchft.__file__, replica_parts.Manager is torchft.manager.Manager,\n"
                "                  issubclass(diloco_sync.DiLoCoSync, torchft.local_sgd.DiLoCo),\n"
                "                  hasattr(torchft, 'Manager')]))")
    path, same_manager, same_diloco, has_manager = found
    assert Path(path).parent.name == "torchft" and FOLDER not in Path(path).parents and Path(path).parent != FOLDER
    assert "site-packages" in path and same_manager and same_diloco and has_manager


def test_the_strategies_load_without_importing_torchft() -> None:
    found = run("import json, sys\n"
                "from fabriclite.strategies import create_strategy, strategy_class\n"
                "from fabriclite.strategies.torchft import diloco, diloco_settings, replica_strategy\n"
                "classes = [strategy_class(name).__name__ for name in ('fault_tolerant', 'diloco', 'local_sgd')]\n"
                "create_strategy('diloco', sync_every=10)\n"
                "print(json.dumps([classes, sorted(m for m in sys.modules if m.split('.')[0] == 'torchft')]))")
    assert found == [["FaultTolerantStrategy", "DiLoCoStrategy", "LocalSGDStrategy"], []]
