"""Collectives over collections: fabriclite against Lightning Fabric, a per-leaf torch.distributed loop and one
flat collective of the same bytes (the limit), on 2 CPU ranks, in one run.

For all_reduce (sum) and all_gather of dicts of 1, 10, 100, 1,000 and 10,000 0-d float32 tensors and of one
16M-float tensor, every implementation is called in turn (interleaved, so load drifts hit all alike) and the
median time per call on rank 0 is reported. fabriclite and the limit get ``--calls`` calls (>= 200) at every
size; Lightning Fabric and the per-leaf loop, which take up to seconds per call, get as many as fit in
``--budget`` seconds (at least 5, at most ``--calls``); the table says how many.

    python benchmarks/collectives.py [--calls 200] [--budget 20] [--markdown docs/collectives.md]
                                     [--plot docs/collectives_benchmark.png]

The script starts its two ranks itself (through torchrun, so that both Fabric objects join one process
group). The plot needs matplotlib (``pip install matplotlib``); without it only the tables are written.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(__file__))
from common import clean_env, table  # noqa: E402

LEAVES = [1, 10, 100, 1000, 10000]
BIG = 16 * 1024 * 1024
IMPLS = ["fabriclite", "Lightning Fabric", "per-leaf loop", "limit", "fabriclite check=False"]
BEGIN, END = "<!-- benchmark:begin -->", "<!-- benchmark:end -->"


# ---------------------------------------------------------------------------------------------- ranks
def _cases(op: str) -> List[Tuple[str, Callable[[], Any], int]]:
    return [(f"{n} x 0-d", lambda n=n: {f"k{i}": __import__("torch").zeros(()) for i in range(n)}, n)
            for n in LEAVES] + [("1 x 16M", lambda: {"t": __import__("torch").zeros(BIG)}, BIG)]


def _impls(op: str, make: Callable[[], Any], numel: int, fabric: Any, lfabric: Any,
           reduce_op: str) -> Dict[str, Callable[[], Any]]:
    import torch
    import torch.distributed as dist

    from fabriclite import collectives

    world = dist.get_world_size()
    data = {name: make() for name in IMPLS}
    flat = torch.zeros(numel)
    if op == "all_reduce":
        def loop() -> None:
            for t in data["per-leaf loop"].values():
                dist.all_reduce(t)
        return {
            "fabriclite": lambda: fabric.all_reduce(data["fabriclite"], reduce_op=reduce_op),
            "Lightning Fabric": lambda: lfabric.all_reduce(data["Lightning Fabric"], reduce_op=reduce_op),
            "per-leaf loop": loop,
            "limit": lambda: dist.all_reduce(flat),
            "fabriclite check=False": lambda: collectives.all_reduce(fabric.strategy, data["fabriclite check=False"],
                                                                     reduce_op=reduce_op, check=False),
        }
    gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out = torch.empty(world * numel)

    def gather_loop() -> Dict[str, Any]:
        result = {}
        for key, t in data["per-leaf loop"].items():
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t)
            result[key] = torch.stack(parts)
        return result
    return {
        "fabriclite": lambda: fabric.all_gather(data["fabriclite"]),
        "Lightning Fabric": lambda: lfabric.all_gather(data["Lightning Fabric"]),
        "per-leaf loop": gather_loop,
        "limit": lambda: gather_flat(out, flat),
        "fabriclite check=False": lambda: collectives.all_gather(fabric.strategy, data["fabriclite check=False"],
                                                                 check=False),
    }


def _call_counts(impls: Dict[str, Callable[[], Any]], calls: int, budget: float) -> Dict[str, int]:
    """Warm every implementation up; agree (max over ranks) on a per-call estimate; give the baselines as many
    calls as fit in ``budget``."""
    import torch
    import torch.distributed as dist

    estimates = []
    for fn in impls.values():
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        estimates.append(statistics.median(times))
    agreed = torch.tensor(estimates, dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    counts = {}
    for name, estimate in zip(impls, agreed.tolist()):
        if name in ("fabriclite", "limit", "fabriclite check=False"):
            counts[name] = calls
        else:
            counts[name] = int(max(5, min(calls, budget / max(estimate, 1e-9))))
    return counts


def _measure(impls: Dict[str, Callable[[], Any]], counts: Dict[str, int]) -> Dict[str, List[float]]:
    times: Dict[str, List[float]] = {name: [] for name in impls}
    for r in range(max(counts.values())):
        for name, fn in impls.items():
            if r < counts[name]:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return times


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from fabriclite import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    from lightning.fabric import Fabric as LightningFabric

    lfabric = LightningFabric(accelerator="cpu", devices=2, strategy="ddp")
    lfabric.launch()
    results: Dict[str, Any] = {}
    for op in ("all_reduce", "all_gather"):
        for label, make, numel in _cases(op):
            if args.only and args.only not in label:
                continue
            impls = _impls(op, make, numel, fabric, lfabric, args.reduce_op)
            counts = _call_counts(impls, args.calls, args.budget)
            times = _measure(impls, counts)
            results[f"{op}|{label}"] = {name: {"median": statistics.median(t), "calls": len(t)}
                                        for name, t in times.items()}
            if dist.get_rank() == 0:
                row = ", ".join(f"{n}: {_fmt(v['median'])} ({v['calls']})" for n, v in results[f'{op}|{label}'].items())
                print(f"  {op} {label}: {row}", file=sys.stderr, flush=True)
            del impls
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"results": results, "torch": torch.__version__, "lightning": _lightning_version(),
                       "cpus": os.cpu_count(), "reduce_op": args.reduce_op, "load": os.getloadavg()[0]}, f)
    fabric.barrier()


def _lightning_version() -> str:
    import lightning

    return str(lightning.__version__)


# ---------------------------------------------------------------------------------------------- report
def _fmt(seconds: float) -> str:
    us = seconds * 1e6
    if us < 1000:
        return f"{us:.0f} us" if us >= 100 else f"{us:.1f} us"
    if us < 1e6:
        return f"{us / 1000:.2f} ms" if us < 10_000 else f"{us / 1000:.1f} ms"
    return f"{us / 1e6:.2f} s"


def report(data: Dict[str, Any]) -> Tuple[str, List[str]]:
    """The Markdown tables and the goal checks."""
    results = data["results"]
    sections, goals = [], []
    for op in ("all_reduce", "all_gather"):
        rows = []
        for key, cell in results.items():
            kind, label = key.split("|")
            if kind != op:
                continue
            f, lt, lp, lim, nc = (cell[n]["median"] for n in IMPLS)
            rows.append([label, _fmt(f), _fmt(lt), _fmt(lp), _fmt(lim), f"{f / lim:.2f}x", f"{lt / f:.1f}x",
                         f"{lp / f:.1f}x", f"{_fmt(nc)} ({nc / lim:.2f}x)",
                         " / ".join(str(cell[n]["calls"]) for n in IMPLS[:4])])
            goals.extend(_goals(op, label, f, lt, lim))
        headers = ["leaves", "fabriclite", "Lightning Fabric", "per-leaf loop", "limit", "fabriclite / limit",
                   "Lightning / fabriclite", "loop / fabriclite", "fabriclite check=False (/ limit)",
                   "calls (f / L / loop / limit)"]
        title = f"**{op}**" + (f" (reduce_op={data['reduce_op']!r} for fabriclite and Lightning)"
                               if op == "all_reduce" else "")
        sections.append(title + "\n\n" + table(headers, rows))
    return "\n\n".join(sections), goals


def _goals(op: str, label: str, f: float, lightning: float, limit: float) -> List[str]:
    out = []
    n = BIG if "16M" in label else int(label.split()[0])
    checks = [(f"faster than Lightning Fabric ({f / lightning:.2f}x its time)", f < lightning)]
    if label == "1 x 0-d":
        checks.append((f"<= 1.3x the limit ({f / limit:.2f}x)", f <= 1.3 * limit))
    if label == "1000 x 0-d":
        checks.append((f"<= 3x the limit ({f / limit:.2f}x)", f <= 3 * limit))
    if label == "10000 x 0-d":
        per_leaf = (f - limit) / n * 1e6
        checks.append((f"<= 2 us per leaf above the limit ({per_leaf:.2f} us)", per_leaf <= 2))
    if "16M" in label:
        checks.append((f"<= 1.1x the limit ({f / limit:.3f}x)", f <= 1.1 * limit))
    for text, ok in checks:
        out.append(f"- [{'x' if ok else ' '}] {op} {label}: {text}")
    return out


def write_markdown(path: str, tables: str, goals: List[str], data: Dict[str, Any], plot: Optional[str]) -> None:
    when = time.strftime("%Y-%m-%d")
    body = (f"{BEGIN}\n_Measured {when} by `python benchmarks/collectives.py` on {data['cpus']} CPU cores, 2 ranks "
            f"(gloo), torch {data['torch']}, lightning {data['lightning']}, load average {data['load']:.1f} at the "
            f"end; medians per call on rank 0. The limit is one torch.distributed collective on a ready flat "
            f"buffer of the same bytes (all_reduce sum / all_gather)._\n\n"
            f"{tables}\n\nGoals:\n\n" + "\n".join(goals) + "\n")
    if plot:
        body += f"\n![time per call against leaves]({os.path.relpath(plot, os.path.dirname(path) or '.')})\n"
    body += END
    text = open(path).read() if os.path.exists(path) else f"# Collectives\n\n{BEGIN}\n{END}\n"
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + body + text[text.index(END) + len(END):]
    else:
        text += "\n" + body + "\n"
    with open(path, "w") as f:
        f.write(text)


def write_plot(path: str, data: Dict[str, Any]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    results = data["results"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, op in zip(axes, ("all_reduce", "all_gather")):
        for name, style in zip(IMPLS, ("o-", "s--", "^:", "k-", "o:")):
            xs, ys = [], []
            for n in LEAVES:
                cell = results.get(f"{op}|{n} x 0-d")
                if cell:
                    xs.append(n)
                    ys.append(cell[name]["median"] * 1e3)
            ax.plot(xs, ys, style, label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("0-d tensors in the dict")
        ax.set_ylabel("ms per call (median)")
        ax.set_title(f"{op}, 2 CPU ranks (gloo)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ---------------------------------------------------------------------------------------------- main
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls for fabriclite and the limit (>= 200)")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per baseline and size")
    parser.add_argument("--markdown", default=None, help="write the tables into this Markdown file")
    parser.add_argument("--plot", default=None, help="write the plot (PNG) here")
    parser.add_argument("--reduce-op", default="mean", help="all_reduce's op for fabriclite and Lightning Fabric")
    parser.add_argument("--only", default=None, help="only the cases whose label contains this (e.g. '1000 x')")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if os.environ.get("FABRICLITE_BENCH_WORKER"):
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), os.path.abspath(__file__), *sys.argv[1:], "--out", out]
        env = clean_env({"FABRICLITE_BENCH_WORKER": "1", "OMP_NUM_THREADS": "1"})
        subprocess.run(cmd, env=env, check=True)
        with open(out) as f:
            data = json.load(f)
    tables, goals = report(data)
    print(tables + "\n\n" + "\n".join(goals))
    plot = args.plot if args.plot and write_plot(args.plot, data) else None
    if args.markdown:
        write_markdown(args.markdown, tables, goals, data, plot)


if __name__ == "__main__":
    main()
