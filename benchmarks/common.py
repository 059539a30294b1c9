"""Small helpers shared by the benchmarks: fresh-process timing, table printing, and the results file every
benchmark writes (``benchmarks/results/<name>.md``: the command, date, machine, load and torch version above
its tables; docs quote measurements only from these files, tests/unit/docs/test_doc_figures.py checks it)."""
from __future__ import annotations

import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")


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


def ratio(value: float, floor: float, what: str = "floor") -> str:
    """``value / floor`` as "1.23x"; "check the <what>" when ``value`` came out below it (a floor or limit
    that is beaten is not one: the measurement, not the code, needs a look)."""
    r = value / floor
    return f"check the {what}" if r < 1 else f"{r:.2f}x"


def load() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


class Results:
    """A benchmark's results file: ``Results(name)``, then ``write(body)`` at the end. It records the command
    line, the date, the CPU count, the load average when it was made and when written, and torch's version."""

    def __init__(self, name: str, argv: Optional[Sequence[str]] = None) -> None:
        self.name = name
        script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
        self.command = " ".join(["python", script, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])
        self.started = time.time()
        self.load_before = load()

    def header(self, extra: Sequence[Tuple[str, str]] = ()) -> str:
        import torch

        lines = [f"# {self.name}", "",
                 f"- command: `{self.command}`",
                 f"- date: {time.strftime('%Y-%m-%d %H:%M', time.localtime(self.started))}"
                 f" ({time.time() - self.started:.0f} s)",
                 f"- machine: {os.cpu_count()} CPUs; load average (1 min) {self.load_before:.1f} before, "
                 f"{load():.1f} after",
                 f"- torch: {torch.__version__}"]
        lines += [f"- {key}: {value}" for key, value in extra]
        return "\n".join(lines)

    def path(self, path: Optional[str] = None) -> str:
        """Where ``write`` writes: ``path``, or benchmarks/results/<name>.md."""
        return path or os.path.join(RESULTS, f"{self.name}.md")

    def write(self, body: str, extra: Sequence[Tuple[str, str]] = (), path: Optional[str] = None) -> str:
        path = self.path(path)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(self.header(extra) + "\n\n" + body.strip() + "\n")
        print(f"wrote {path}", file=sys.stderr)
        return path
