"""How long each engine's recovery takes, in parts, written to benchmarks/results/engines.md.

One module per engine in benchmarks/engine_parts/ (slurm, torchrun, ray; see its __init__.py): ``available()``
says whether the engine can run here (an engine that cannot is skipped with its one line, in the output and in the
results file), ``measure(repeats)`` returns the recovery's parts in order, one value per repeat:

- SLURM: signal -> saved -> requeued -> started again (SLURM's own delay, its own part) -> training again;
- torchrun and Ray: failure -> training again, in the parts each module names.

    .venv/bin/python benchmarks/engines.py [--repeats 2] [--engines slurm torchrun ray]

The SLURM part needs root (it starts a 3-node cluster on this machine); each SLURM repeat takes SLURM's ~2 minutes
of requeue delay. An engine module may need another interpreter (Ray's lane environment): it says so in its
``available()`` line, or runs its own subprocesses.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))

from common import Results, table  # noqa: E402

ENGINES = ("slurm", "torchrun", "ray")


def load(engine: str) -> Tuple[Optional[object], Optional[str]]:
    """(the engine_parts module, None) or (None, why it is skipped)."""
    try:
        module = importlib.import_module(f"engine_parts.{engine}")
    except ImportError as err:
        return None, f"benchmarks/engine_parts/{engine}.py could not be imported: {err}"
    why = module.available()
    return (module, None) if why is None else (None, why)


def section(engine: str, parts: Dict[str, List[float]], took: float) -> str:
    rows = []
    total = [sum(values) for values in zip(*parts.values())] if parts else []
    for name, values in list(parts.items()) + [("total", total)]:
        if not values:
            continue
        rows.append((name, f"{statistics.median(values):.2f}", f"{min(values):.2f}", f"{max(values):.2f}",
                     ", ".join(f"{v:.2f}" for v in values)))
    import torch

    when = time.strftime("%Y-%m-%d %H:%M")
    return (f"## {engine}\n\nMeasured {when}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, torch "
            f"{torch.__version__}; {len(total)} repeat(s), {took:.0f} s in all. Seconds:\n\n"
            + table(["part", "median", "min", "max", "each repeat"], rows))


def earlier_sections(path: str, engines: Sequence[str]) -> Dict[str, str]:
    """The sections of engines not measured by this run, kept from the results file (each names its own date):
    the lanes' engines can be measured separately (``--engines slurm``)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        text = f.read()
    kept = {}
    for chunk in text.split("\n## ")[1:]:
        name = chunk.split("\n", 1)[0].strip()
        if name in ENGINES and name not in engines:
            kept[name] = "## " + chunk.strip()
    return kept


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected at least 1")
    results = Results("engines")
    body, skipped = [], []
    for engine in args.engines:
        module, why = load(engine)
        if module is None:
            print(f"engines: {engine} skipped: {why}", file=sys.stderr)
            skipped.append(f"- {engine}: skipped: {why}")
            continue
        start = time.monotonic()
        parts = module.measure(args.repeats)
        body.append(section(engine, parts, time.monotonic() - start))
        print(body[-1], file=sys.stderr)
    kept = earlier_sections(results.path(), args.engines)
    body += [kept[engine] + "\n\n(kept from an earlier run of this file's command with --engines " + engine + ")"
             for engine in ENGINES if engine in kept and "(kept from an earlier run" not in kept[engine]]
    body += [kept[engine] for engine in ENGINES if engine in kept and "(kept from an earlier run" in kept[engine]]
    if skipped:
        body.append("## Not measured in this run\n\n" + "\n".join(skipped))
    results.write("\n\n".join(body))


if __name__ == "__main__":
    main()
