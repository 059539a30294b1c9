"""Launch and import time: fabriclite against Lightning Fabric, in one run.

- launch: wall time from starting ``python script.py`` to rank 0's first barrier done, devices=2 on CPU
  (script mode for both), and to the job's exit.
- import: ``import fabriclite`` against ``import torch`` in fresh interpreters.

    python benchmarks/launch.py [--repeats 7]

writes benchmarks/results/launch.md (``--results PATH`` elsewhere).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, median, run_python, table  # noqa: E402

SCRIPT = """
import os, sys, time
from {module} import Fabric
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
fabric.barrier()
if fabric.global_rank == 0:
    print("BARRIER", time.time() - float(os.environ["BENCH_T0"]), flush=True)
"""
IMPORT = "import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"


def time_launch(path: str) -> tuple:
    t0 = time.time()
    out = run_python([path], env={"BENCH_T0": repr(t0)})
    total = time.time() - t0
    barrier = float(next(line.split()[1] for line in out.splitlines() if line.startswith("BARRIER")))
    return barrier, total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--results", default=None, help="the results file (benchmarks/results/launch.md)")
    args = parser.parse_args()
    results = Results("launch")

    frameworks = {"fabriclite": "fabriclite", "Lightning Fabric": "lightning.fabric"}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, module in frameworks.items():
            paths[name] = os.path.join(tmp, f"bench_{module.replace('.', '_')}.py")
            with open(paths[name], "w") as f:
                f.write(SCRIPT.format(module=module))
        launch = {name: [] for name in frameworks}
        imports = {m: [] for m in ("torch", "fabriclite", "lightning.fabric")}
        for _ in range(args.repeats):  # interleaved, so load drifts hit both alike
            for name in frameworks:
                launch[name].append(time_launch(paths[name]))
            for module in imports:
                imports[module].append(float(run_python(["-c", IMPORT.format(module=module)]).strip()))

    base_barrier = median([b for b, _ in launch["Lightning Fabric"]])
    rows = []
    for name in frameworks:
        barrier = median([b for b, _ in launch[name]])
        total = median([t for _, t in launch[name]])
        rows.append([name, f"{barrier:.2f} s", f"{total:.2f} s", f"{barrier / base_barrier:.2f}x"])
    torch_import = median(imports["torch"])
    import_rows = [[m, f"{median(v):.3f} s", f"{median(v) - torch_import:+.3f} s"] for m, v in imports.items()]
    text = (f"Launch, devices=2 on CPU, medians of {args.repeats} interleaved runs\n\n"
            + table(["framework", "start -> first barrier done", "start -> exit", "vs Lightning"], rows)
            + "\n\nImport time (fresh interpreter)\n\n"
            + table(["import", "time", "vs torch"], import_rows) + "\n")
    print(text)
    import lightning

    results.write(text, extra=[("lightning", lightning.__version__)], path=args.results)


if __name__ == "__main__":
    main()
