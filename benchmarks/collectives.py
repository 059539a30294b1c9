"""Collectives over collections: fabriclite against Lightning Fabric, a per-leaf torch.distributed loop, two
hand-written floors and one flat collective of the same bytes (the limit), on 2 CPU ranks, in one run.

For all_reduce (mean) and all_gather of dicts of 1, 10, 100, 1,000 and 10,000 0-d float32 tensors and of one
16M-float tensor, every implementation is called in turn (interleaved, so load drifts hit all alike) and the
median time per call on rank 0 is kept (``--big-calls`` (40) for the 16M-float cases; each round starts one implementation further along, so none always
runs right after the same one). fabriclite, the floors and the limit get ``--calls`` calls (>= 200)
at every size; Lightning Fabric and the per-leaf loop, which take up to seconds per call, get as many as fit
in ``--budget`` seconds (at least 5, at most ``--calls``); the table says how many. The floors
(benchmarks/collectives_floors.py): (a) the least hand-written Python that reads the leaves, runs one
collective and hands back the same structure and types; (b) the same with the least agreement check.

The whole run is repeated ``--runs`` times (3), each a fresh pair of ranks; the tables give the median over
the runs of each per-run median, the goals the median over the runs of each per-run ratio (a ratio is taken
between numbers of the same run), with the load average of each run.

    python benchmarks/collectives.py [--runs 3] [--calls 200] [--big-calls 40] [--budget 5] [--markdown docs/collectives.md]
                                     [--plot docs/collectives_benchmark.png]

The script starts its two ranks itself (through torchrun, so that both Fabric objects join one process
group). The plot needs matplotlib (``pip install matplotlib``); without it only the tables are written.
"""
from __future__ import annotations

import argparse
import inspect
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
SLOW = ("Lightning Fabric", "per-leaf loop")
BEGIN, END = "<!-- benchmark:begin -->", "<!-- benchmark:end -->"


def impl_names(op: str) -> List[str]:
    inplace = ["fabriclite inplace"] if op == "all_reduce" else []
    return ["fabriclite", *inplace, "fabriclite check=False", "floor (a)", "floor (b)", "limit", *SLOW]


# ---------------------------------------------------------------------------------------------- ranks
def _cases() -> List[Tuple[str, Callable[[], Any], int]]:
    import torch

    return [(f"{n} x 0-d", lambda n=n: {f"k{i}": torch.zeros(()) for i in range(n)}, n)
            for n in LEAVES] + [("1 x 16M", lambda: {"t": torch.zeros(BIG)}, BIG)]


def _impls(op: str, make: Callable[[], Any], numel: int, fabric: Any, lfabric: Any, reduce_op: str,
           baselines: bool, slow_max: int) -> Dict[str, Callable[[], Any]]:
    import torch
    import torch.distributed as dist

    from collectives_floors import floors
    from fabriclite import collectives

    names = [n for n in impl_names(op) if n not in SLOW or (baselines and numel <= slow_max)]
    if "inplace" not in inspect.signature(collectives.all_reduce).parameters:  # measuring an older version
        names = [n for n in names if n != "fabriclite inplace"]
    world = dist.get_world_size()
    data = {name: make() for name in names}
    flat = torch.zeros(numel)
    floor = floors(op, reduce_op)
    impls: Dict[str, Callable[[], Any]] = {
        "floor (a)": lambda: floor["floor (a)"](data["floor (a)"]),
        "floor (b)": lambda: floor["floor (b)"](data["floor (b)"]),
    }
    if op == "all_reduce":
        def loop() -> None:
            for t in data["per-leaf loop"].values():
                dist.all_reduce(t)
        impls.update({
            "fabriclite": lambda: fabric.all_reduce(data["fabriclite"], reduce_op=reduce_op),
            "fabriclite inplace": lambda: collectives.all_reduce(fabric.strategy, data["fabriclite inplace"],
                                                                 reduce_op=reduce_op, inplace=True),
            "Lightning Fabric": lambda: lfabric.all_reduce(data["Lightning Fabric"], reduce_op=reduce_op),
            "per-leaf loop": loop,
            "limit": lambda: dist.all_reduce(flat),
            "fabriclite check=False": lambda: collectives.all_reduce(fabric.strategy, data["fabriclite check=False"],
                                                                     reduce_op=reduce_op, check=False),
        })
    else:
        gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        out = torch.empty(world * numel)

        def gather_loop() -> Dict[str, Any]:
            result = {}
            for key, t in data["per-leaf loop"].items():
                parts = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(parts, t)
                result[key] = torch.stack(parts)
            return result
        impls.update({
            "fabriclite": lambda: fabric.all_gather(data["fabriclite"]),
            "Lightning Fabric": lambda: lfabric.all_gather(data["Lightning Fabric"]),
            "per-leaf loop": gather_loop,
            "limit": lambda: gather_flat(out, flat),
            "fabriclite check=False": lambda: collectives.all_gather(fabric.strategy, data["fabriclite check=False"],
                                                                     check=False),
        })
    return {name: impls[name] for name in names}


def _call_counts(impls: Dict[str, Callable[[], Any]], calls: int, budget: float) -> Dict[str, int]:
    """Warm every implementation up; agree (max over ranks) on a per-call estimate; give the baselines as many
    calls as fit in ``budget``."""
    import torch
    import torch.distributed as dist

    def timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    # every rank must make the same calls: how many warm-up calls follows from times agreed over the ranks
    agreed = torch.tensor([timed(fn) for fn in impls.values()], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    for k, (fn, first) in enumerate(zip(impls.values(), agreed.tolist())):
        if first < 0.2:
            agreed[k] = statistics.median([first, timed(fn), timed(fn)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return {name: calls if name not in SLOW else int(max(5, min(calls, budget / max(estimate, 1e-9))))
            for name, estimate in zip(impls, agreed.tolist())}


def _measure(impls: Dict[str, Callable[[], Any]], counts: Dict[str, int]) -> Dict[str, List[float]]:
    times: Dict[str, List[float]] = {name: [] for name in impls}
    order = list(impls.items())
    for r in range(max(counts.values())):
        k = r % len(order)  # each round starts one further along: no implementation always follows the same one
        for name, fn in order[k:] + order[:k]:
            if r < counts[name]:
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return times


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    from fabriclite import Fabric

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    lfabric = None
    if not args.no_baselines:
        from lightning.fabric import Fabric as LightningFabric

        lfabric = LightningFabric(accelerator="cpu", devices=2, strategy="ddp")
        lfabric.launch()
    results: Dict[str, Any] = {}
    for op in ("all_reduce", "all_gather"):
        for label, make, numel in _cases():
            if args.only and args.only not in f"{op} {label}":
                continue
            slow_max = BIG if numel == BIG else args.baselines_up_to
            impls = _impls(op, make, numel, fabric, lfabric, args.reduce_op, not args.no_baselines, slow_max)
            counts = _call_counts(impls, args.big_calls if numel == BIG else args.calls, args.budget)
            times = _measure(impls, counts)
            results[f"{op}|{label}"] = {name: {"median": statistics.median(t), "calls": len(t)}
                                        for name, t in times.items()}
            if dist.get_rank() == 0:
                row = ", ".join(f"{n}: {_fmt(v['median'])}" for n, v in results[f'{op}|{label}'].items())
                print(f"  {op} {label}: {row}", file=sys.stderr, flush=True)
            del impls
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"results": results, "torch": torch.__version__, "lightning": _lightning_version(),
                       "cpus": os.cpu_count(), "reduce_op": args.reduce_op,
                       "load": [load_start, os.getloadavg()[0]]}, f)
    fabric.barrier()


def _lightning_version() -> str:
    try:
        import lightning
    except ImportError:
        return "not installed"
    return str(lightning.__version__)


# ---------------------------------------------------------------------------------------------- report
def _fmt(seconds: float) -> str:
    us = seconds * 1e6
    if us < 1000:
        return f"{us:.0f} us" if us >= 100 else f"{us:.1f} us"
    if us < 1e6:
        return f"{us / 1000:.2f} ms" if us < 10_000 else f"{us / 1000:.1f} ms"
    return f"{us / 1e6:.2f} s"


def _median_of_runs(runs: List[Dict[str, Any]], key: str, fn: Callable[[Dict[str, float]], float]) -> float:
    """The median over the runs of ``fn(medians of that run)`` for case ``key``."""
    return statistics.median(fn({n: v["median"] for n, v in run["results"][key].items()}) for run in runs)


def report(runs: List[Dict[str, Any]]) -> Tuple[str, List[str]]:
    """The Markdown tables (medians over the runs) and the goal checks."""
    sections, goals = [], []
    keys = list(runs[0]["results"])
    for op in ("all_reduce", "all_gather"):
        op_keys = [k for k in keys if k.startswith(op + "|")]
        if not op_keys:
            continue
        present = set().union(*(runs[0]["results"][k] for k in op_keys))
        names = [n for n in impl_names(op) if n in present]
        rows = []
        for key in op_keys:
            kind, label = key.split("|")
            have = runs[0]["results"][key]
            med = {n: _median_of_runs(runs, key, lambda m, n=n: m[n]) for n in names if n in have}
            ratio = {ref: _median_of_runs(runs, key, lambda m, ref=ref: m["fabriclite"] / m[ref])
                     for ref in ("limit", "floor (a)", "floor (b)")}
            row = [label, *(_fmt(med[n]) if n in med else "-" for n in names), f"{ratio['limit']:.2f}x",
                   f"{ratio['floor (a)']:.2f}x", f"{ratio['floor (b)']:.2f}x"]
            if "Lightning Fabric" in names:
                light = (f"{_median_of_runs(runs, key, lambda m: m['Lightning Fabric'] / m['fabriclite']):.1f}x"
                         if "Lightning Fabric" in have else "-")
                row += [light, " / ".join(str(have[n]["calls"]) if n in have else "-" for n in ("fabriclite", *SLOW))]
            rows.append(row)
            goals.extend(_goals(op, label, runs, key))
        headers = ["leaves", *names, "fabriclite / limit", "fabriclite / (a)", "fabriclite / (b)"]
        if "Lightning Fabric" in names:
            headers += ["Lightning / fabriclite", "calls (f / L / loop)"]
        title = f"**{op}**" + (f" (reduce_op={runs[0]['reduce_op']!r})" if op == "all_reduce" else "")
        sections.append(title + "\n\n" + table(headers, rows))
    return "\n\n".join(sections), goals


def _goals(op: str, label: str, runs: List[Dict[str, Any]], key: str) -> List[str]:
    """The issue's goals for this case: each a quantity taken within one run, its median over the runs."""
    n = BIG if "16M" in label else int(label.split()[0])
    checks: List[Tuple[str, Callable[[Dict[str, float]], float], float, str]] = []
    if label == "1 x 0-d" and op == "all_reduce":
        checks += [("<= 1.15x floor (b)", lambda m: m["fabriclite"] / m["floor (b)"], 1.15, "x"),
                   ("<= 1.6x the limit", lambda m: m["fabriclite"] / m["limit"], 1.6, "x")]
    if label == "1000 x 0-d":
        checks.append(("overhead above the limit <= 1.3x floor (a)'s",
                       lambda m: (m["fabriclite"] - m["limit"]) / max(m["floor (a)"] - m["limit"], 1e-9), 1.3, "x"))
        most = 2.5 if op == "all_reduce" else 3.0
        checks.append((f"<= {most}x the limit", lambda m: m["fabriclite"] / m["limit"], most, "x"))
    if label == "10000 x 0-d":
        checks.append(("<= 1 us per leaf above floor (a)", lambda m: (m["fabriclite"] - m["floor (a)"]) / n * 1e6,
                       1.0, " us"))
    if "16M" in label and op == "all_reduce":
        if {"Lightning Fabric", "fabriclite inplace"} <= set(runs[0]["results"][key]):
            checks.append(("inplace=True <= Lightning Fabric", lambda m: m["fabriclite inplace"] / m["Lightning Fabric"],
                           1.0, "x its time"))
        checks.append(("default <= 1.2x the limit", lambda m: m["fabriclite"] / m["limit"], 1.2, "x"))
    out = []
    for text, fn, goal, unit in checks:
        per_run = [fn({k: v["median"] for k, v in run["results"][key].items()}) for run in runs]
        value = statistics.median(per_run)
        seen = ", ".join(f"{v:.2f}" for v in per_run)
        floors = "; ".join(f"{name} {_fmt(_median_of_runs(runs, key, lambda m, name=name: m[name]))}"
                           for name in ("fabriclite", "fabriclite inplace", "floor (a)", "floor (b)", "limit",
                                        "Lightning Fabric") if name in runs[0]["results"][key])
        out.append(f"- [{'x' if value <= goal else ' '}] {op} {label}: {text}: {value:.2f}{unit} "
                   f"(runs: {seen}; medians: {floors})")
    return out


def write_markdown(path: str, tables: str, goals: List[str], runs: List[Dict[str, Any]], plot: Optional[str]) -> None:
    when = time.strftime("%Y-%m-%d")
    first = runs[0]
    loads = ", ".join(f"{a:.1f} -> {b:.1f}" for a, b in (run["load"] for run in runs))
    body = (f"{BEGIN}\n_Measured {when} by `python benchmarks/collectives.py` on {first['cpus']} CPU cores, 2 ranks "
            f"(gloo), torch {first['torch']}, lightning {first['lightning']}: {len(runs)} runs, each a fresh pair of "
            f"ranks; load average (1 min) at the start -> end of each run: {loads}. Each cell is the median over "
            f"the runs of the per-run median per call on rank 0; each ratio the median over the runs of the ratio "
            f"within a run. The limit is one torch.distributed collective on a ready flat buffer of the same bytes "
            f"(all_reduce sum / all_gather); floors (a) and (b): benchmarks/collectives_floors.py._\n\n"
            f"{tables}\n\nGoals (the median over the runs of a quantity taken within each run):\n\n"
            + "\n".join(goals) + "\n")
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


def write_plot(path: str, runs: List[Dict[str, Any]]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    styles = {"fabriclite": ("o-", "C0"), "fabriclite inplace": ("o--", "C1"), "floor (a)": ("v-", "C2"),
              "floor (b)": ("^-", "C3"), "limit": ("-", "k"), "Lightning Fabric": ("s--", "C4"),
              "per-leaf loop": ("x:", "C5")}
    for ax, op in zip(axes, ("all_reduce", "all_gather")):
        for name in impl_names(op):
            if name not in styles:
                continue
            xs, ys = [], []
            for n in LEAVES:
                key = f"{op}|{n} x 0-d"
                if key in runs[0]["results"] and name in runs[0]["results"][key]:
                    xs.append(n)
                    ys.append(_median_of_runs(runs, key, lambda m: m[name]) * 1e3)
            if xs:
                ax.plot(xs, ys, styles[name][0], color=styles[name][1], label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("0-d tensors in the dict")
        ax.set_ylabel(f"ms per call (median of {len(runs)} runs)")
        ax.set_title(f"{op}, 2 CPU ranks (gloo)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
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
    parser.add_argument("--runs", type=int, default=3, help="whole runs, each a fresh pair of ranks (3)")
    parser.add_argument("--calls", type=int, default=200, help="calls for fabriclite, the floors and the limit")
    parser.add_argument("--big-calls", type=int, default=40, help="the same for the 16M-float cases")
    parser.add_argument("--budget", type=float, default=5.0, help="seconds per baseline and size")
    parser.add_argument("--markdown", default=None, help="write the tables into this Markdown file")
    parser.add_argument("--plot", default=None, help="write the plot (PNG) here")
    parser.add_argument("--reduce-op", default="mean", help="all_reduce's op for fabriclite and Lightning Fabric")
    parser.add_argument("--only", default=None, help="only the cases whose 'op label' contains this ('all_reduce 1 x')")
    parser.add_argument("--no-baselines", action="store_true", help="leave Lightning Fabric and the loop out")
    parser.add_argument("--baselines-up-to", type=int, default=1000,
                        help="leaves up to which Lightning Fabric and the loop run (seconds per call above; 16M: always)")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="also write every run's raw numbers here")
    args = parser.parse_args()
    if os.environ.get("FABRICLITE_BENCH_WORKER"):
        worker(args)
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.runs):
            out = os.path.join(tmp, f"run{r}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", str(_free_port()), os.path.abspath(__file__), *sys.argv[1:], "--out", out]
            env = clean_env({"FABRICLITE_BENCH_WORKER": "1", "OMP_NUM_THREADS": "1"})
            print(f"run {r + 1} of {args.runs}", file=sys.stderr, flush=True)
            subprocess.run(cmd, env=env, check=True)
            with open(out) as f:
                runs.append(json.load(f))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    tables, goals = report(runs)
    print(tables + "\n\n" + "\n".join(goals))
    plot = args.plot if args.plot and write_plot(args.plot, runs) else None
    if args.markdown:
        write_markdown(args.markdown, tables, goals, runs, plot)


if __name__ == "__main__":
    main()
