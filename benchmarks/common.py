"""Small helpers shared by the benchmarks: fresh-process timing and table printing."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
from typing import Dict, List, Optional, Sequence


def clean_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    drop = ("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "FABRICLITE_", "SLURM_", "OMPI_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra or {})
    return env


def run_python(args: Sequence[str], env: Optional[Dict[str, str]] = None, timeout: float = 300) -> str:
    """stdout of ``python args``; raises with stderr when it fails."""
    proc = subprocess.run([sys.executable, *args], env=clean_env(env), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def median(values: List[float]) -> float:
    return statistics.median(values)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
