"""Helpers for tests that start fresh processes: run a script, parse the JSON lines ranks print."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

#: the repository's root (this file is tests/support/helpers.py)
REPO = Path(__file__).resolve().parents[2]

#: variables through which a scheduler or launcher tells a process who it is
CLUSTER_VARS = re.compile(
    r"^(SLURM_|OMPI_|PMI_|PMIX_|MV2_|LSB_|JSM_|TORCHELASTIC_|FABRICLITE_(?!JOB_SECRET_FILE$)|MASTER_ADDR$|MASTER_PORT$|RANK$|"
    r"WORLD_SIZE$|LOCAL_RANK$|LOCAL_WORLD_SIZE$|NODE_RANK$|GROUP_RANK$|XRT_|TPU_|PJRT_)"
)


def _port_range(value: Optional[str]) -> Tuple[int, int]:
    """``LOW-HIGH`` (both included) as the range free_port picks from; the default when not given."""
    if not value:
        return (20000, 32000)
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", value)
    if not match or not 1024 <= int(match.group(1)) < int(match.group(2)) <= 65535:
        raise ValueError(f"FL_TEST_PORTS={value!r}: give LOW-HIGH, 1024 <= LOW < HIGH <= 65535 (e.g. 20000-25999)")
    return (int(match.group(1)), int(match.group(2)) + 1)


#: where free_port picks: below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 here), so
#: no process is handed one of these ports by bind(0) or as a connection's source port between the pick and the
#: job's own bind. ``FL_TEST_PORTS=LOW-HIGH`` narrows it: `make test` gives the core suite and the lanes, which run
#: side by side, ranges of their own, so no two tests running at once can pick the same port.
PORT_RANGE = _port_range(os.environ.get("FL_TEST_PORTS"))
_given: Set[int] = set()


def free_port() -> int:
    """A port nothing listens on (checked by binding it on every address), never handed out before in this
    session, from PORT_RANGE (a start that depends on the process id spreads concurrent sessions apart)."""
    low, high = PORT_RANGE
    span = high - low
    start = (os.getpid() * 7919) % span
    for k in range(span):
        port = low + (start + k) % span
        if port in _given:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


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
