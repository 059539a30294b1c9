"""Helpers for tests that start fresh processes: run a script, parse the JSON lines ranks print."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Sequence

#: the repository's root (this file is tests/support/helpers.py)
REPO = Path(__file__).resolve().parents[2]

#: variables through which a scheduler or launcher tells a process who it is
CLUSTER_VARS = re.compile(
    r"^(SLURM_|OMPI_|PMI_|PMIX_|MV2_|LSB_|JSM_|TORCHELASTIC_|FABRICLITE_|MASTER_ADDR$|MASTER_PORT$|RANK$|"
    r"WORLD_SIZE$|LOCAL_RANK$|LOCAL_WORLD_SIZE$|NODE_RANK$|GROUP_RANK$|XRT_|TPU_|PJRT_)"
)


def clean_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """This process's environment without cluster variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not CLUSTER_VARS.match(k)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def write_script(directory: Path, body: str, name: str = "script.py") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(body))
    return path


def run(args: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: float = 60,
        cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), env=clean_env(env), capture_output=True, text=True, timeout=timeout, cwd=cwd)


def python(script: Path, *args: str, env: Optional[Dict[str, str]] = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return run([sys.executable, str(script), *args], env=env, timeout=timeout)


def json_lines(output: str, tag: str = "FACTS ") -> List[dict]:
    """The JSON objects printed after ``tag`` at the start of a line."""
    return [json.loads(line[len(tag):]) for line in output.splitlines() if line.startswith(tag)]
