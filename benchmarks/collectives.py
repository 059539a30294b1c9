"""Collectives over collections: fabriclite against Lightning Fabric, a per-leaf torch.distributed loop, two
hand-written floors and one flat collective of the same bytes (the limit), on 2 CPU ranks (gloo) or one rank
per GPU (``--backend nccl``), in one run.

For all_reduce (mean) and all_gather of dicts of 1, 10, 100, 1,000 and 10,000 0-d float32 tensors and of one
16M-float tensor, every implementation is called in turn (interleaved, so load drifts hit all alike; each
round starts one implementation further along, so none always runs right after the same one), in two
regimes:

- **drop**: each call timed alone, its result dropped at once (a loop that logs and forgets). Result buffers
  can then be reused: fabriclite's pool does it, and so do the floors, where it is legal.
- **keep**: windows of ``--keep-window`` timed calls (``--big-keep-window`` for 16M floats) whose results are
  all kept until the window ends, after ``KEEP_UNTIMED`` untimed calls whose results are kept too (so a pool
  of up to that many buffers is used up before the timer starts): a loop that keeps its metrics. The time
  per call is the window's over its calls. Lightning Fabric and the per-leaf loop reduce in the caller's
  tensors (nothing to keep): drop regime only.

fabriclite, the floors and the limit get ``--calls`` calls (>= 200) at every size (``--big-calls`` (40) for
the 16M-float cases); Lightning Fabric and the per-leaf loop, which take up to seconds per call, get as many
as fit in ``--budget`` seconds (at least 5, at most ``--calls``); the table says how many. The floors
(benchmarks/collectives_floors.py): (a) the least hand-written Python that reads the leaves, runs one
collective and hands back the same structure and types; (b) the same with the least agreement check. Both
reuse result buffers as fabriclite does. A ratio of fabriclite to a floor or the limit that comes out below
1 is printed as "check the floor" (or limit): a floor that is beaten is not one.

The whole run is repeated ``--runs`` times (3), each a fresh set of ranks; the tables give the median over
the runs of each per-run median, the goals the median over the runs of each per-run ratio (a ratio is taken
between numbers of the same run). The first run also profiles fabriclite's calls in the goals' cases
(cProfile on rank 0); a goal that is missed gets its case's profile in the results file.

    python benchmarks/collectives.py [--runs 3] [--calls 200] [--big-calls 40] [--budget 5]
                                     [--plot docs/collectives_benchmark.png]
    python benchmarks/collectives.py --backend nccl [--ranks N]      # one rank per GPU

writes benchmarks/results/collectives.md (``collectives_nccl.md`` with nccl; ``--results PATH`` elsewhere).
The script starts its ranks itself (through torchrun, so that both Fabric objects join one process group).
The plot needs matplotlib (the ``bench`` extra); without it only the tables are written.
"""
from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(__file__))
from collectives_report import (KEEP_UNTIMED, LEAVES, REGIMES, SLOW, fmt, impl_names, report,  # noqa: E402
                                write_plot, write_results)
from common import Results, clean_env  # noqa: E402

BIG = 16 * 1024 * 1024
#: the goals' cases ("op|label"), profiled in the first run
GOAL_CASES = ("all_reduce|1 x 0-d", "all_reduce|1000 x 0-d", "all_gather|1000 x 0-d")


# ---------------------------------------------------------------------------------------------- ranks
def _cases(device: Any) -> List[Tuple[str, Callable[[], Any], int]]:
    import torch

    return [(f"{n} x 0-d", lambda n=n: {f"k{i}": torch.zeros((), device=device) for i in range(n)}, n)
            for n in LEAVES] + [("1 x 16M", lambda: {"t": torch.zeros(BIG, device=device)}, BIG)]


def _impls(op: str, make: Callable[[], Any], numel: int, fabric: Any, lfabric: Any, args: argparse.Namespace,
           baselines: bool, slow_max: int, device: Any) -> Dict[str, Callable[[], Any]]:
    import torch
    import torch.distributed as dist

    from collectives_floors import floors
    from fabriclite import collectives

    reduce_op = args.reduce_op
    names = [n for n in impl_names(op, args.backend) if n not in SLOW or (baselines and numel <= slow_max)]
    if "inplace" not in inspect.signature(collectives.all_reduce).parameters:  # measuring an older version
        names = [n for n in names if n != "fabriclite inplace"]
    world = dist.get_world_size()
    data = {name: make() for name in names}
    flat = torch.zeros(numel, device=device)
    floor = floors(op, reduce_op, device)
    impls: Dict[str, Callable[[], Any]] = {name: (lambda fn=fn, name=name: fn(data[name]))
                                           for name, fn in floor.items()}
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
        out = torch.empty(world * numel, device=device)
        gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

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


def _call_counts(impls: Dict[str, Callable[[], Any]], calls: int, budget: float, device: Any) -> Dict[str, int]:
    """Warm every implementation up; agree (max over ranks) on a per-call estimate; give the baselines as many
    calls as fit in ``budget``. The estimates travel on ``device`` (NCCL has no CPU tensors)."""
    import torch
    import torch.distributed as dist

    def timed(fn: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    # every rank must make the same calls: how many warm-up calls follows from times agreed over the ranks
    agreed = torch.tensor([timed(fn) for fn in impls.values()], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    for k, (fn, first) in enumerate(zip(impls.values(), agreed.tolist())):
        if first < 0.2:
            agreed[k] = statistics.median([first, timed(fn), timed(fn)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return {name: calls if name not in SLOW else int(max(5, min(calls, budget / max(estimate, 1e-9))))
            for name, estimate in zip(impls, agreed.tolist())}


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _measure_drop(impls: Dict[str, Callable[[], Any]], counts: Dict[str, int], device: Any) -> Dict[str, List[float]]:
    """Each call timed alone; its result dropped at once."""
    times: Dict[str, List[float]] = {name: [] for name in impls}
    order = list(impls.items())
    for r in range(max(counts.values())):
        k = r % len(order)  # each round starts one further along: no implementation always follows the same one
        for name, fn in order[k:] + order[:k]:
            if r < counts[name]:
                t0 = time.perf_counter()
                fn()
                _sync(device)
                times[name].append(time.perf_counter() - t0)
    return times


def _measure_keep(impls: Dict[str, Callable[[], Any]], calls: int, window: int, device: Any) -> Dict[str, List[float]]:
    """Windows of ``window`` timed calls per implementation, every result of the window (and of its
    KEEP_UNTIMED untimed calls before) kept until the window ends; the time per call of each window. A full
    garbage collection runs before each window, untimed: the kept results make the collector's generations fill,
    and a full collection (about 200 ms over this process's 350,000 objects) otherwise lands in whichever
    window crosses its threshold (one in three of fabriclite's windows at 1,000 leaves, seen in a run)."""
    times: Dict[str, List[float]] = {name: [] for name in impls if name not in SLOW}
    order = [(name, fn) for name, fn in impls.items() if name not in SLOW]
    for r in range(max(3, calls // (window + KEEP_UNTIMED))):
        k = r % len(order)
        for name, fn in order[k:] + order[:k]:
            gc.collect()  # a full collection's cost follows the process's objects, not the implementation's
            kept = [fn() for _ in range(KEEP_UNTIMED)]
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(window):
                kept.append(fn())
            _sync(device)
            times[name].append((time.perf_counter() - t0) / window)
            del kept
    return times


def _profile(fn: Callable[[], Any], calls: int, profile: bool) -> Optional[str]:
    """The top of a cProfile of ``calls`` calls of ``fn`` (results dropped), by own time; None where
    ``profile`` is False (the other ranks make the same calls unprofiled)."""
    if not profile:
        for _ in range(calls):
            fn()
        return None
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(14)
    text = out.getvalue()
    return text[text.index("ncalls"):] if "ncalls" in text else text


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    load_start = os.getloadavg()[0]
    from fabriclite import Fabric

    accelerator = "cuda" if args.backend == "nccl" else "cpu"
    ranks = int(os.environ["WORLD_SIZE"])
    fabric = Fabric(accelerator=accelerator, devices=ranks, strategy="ddp")
    fabric.launch()
    device = fabric.device
    lfabric = None
    if not args.no_baselines:
        from lightning.fabric import Fabric as LightningFabric

        lfabric = LightningFabric(accelerator=accelerator, devices=ranks, strategy="ddp")
        lfabric.launch()
    results: Dict[str, Any] = {}
    profiles: Dict[str, str] = {}
    profiling = os.environ.get("FABRICLITE_BENCH_PROFILE") == "1"
    for op in ("all_reduce", "all_gather"):
        for label, make, numel in _cases(device):
            if args.only and not any(part in f"{op} {label}" for part in args.only.split(",")):
                continue
            key = f"{op}|{label}"
            slow_max = BIG if numel == BIG else args.baselines_up_to
            impls = _impls(op, make, numel, fabric, lfabric, args, not args.no_baselines, slow_max, device)
            calls = args.big_calls if numel == BIG else args.calls
            counts = _call_counts(impls, calls, args.budget, device)
            drop = _measure_drop(impls, counts, device)
            keep = _measure_keep(impls, calls, args.big_keep_window if numel == BIG else args.keep_window, device)
            results[key] = {regime: {name: {"median": statistics.median(t), "calls": len(t)}
                                     for name, t in times.items()}
                            for regime, times in (("drop", drop), ("keep", keep))}
            if profiling and key in GOAL_CASES:
                text = _profile(impls["fabriclite"], calls, dist.get_rank() == 0)
                if text:
                    profiles[key] = text
            if dist.get_rank() == 0:
                for regime in REGIMES:
                    row = ", ".join(f"{n}: {fmt(v['median'])}" for n, v in results[key][regime].items())
                    print(f"  {op} {label} [{regime}]: {row}", file=sys.stderr, flush=True)
            del impls
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"results": results, "profiles": profiles, "torch": torch.__version__,
                       "lightning": _lightning_version(), "cpus": os.cpu_count(), "reduce_op": args.reduce_op,
                       "backend": args.backend, "ranks": ranks, "device": _device_name(device),
                       "load": [load_start, os.getloadavg()[0]]}, f)
    fabric.barrier()


def _device_name(device: Any) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return "cpu"


def _lightning_version() -> str:
    try:
        import lightning
    except ImportError:
        return "not installed"
    return str(lightning.__version__)


# ---------------------------------------------------------------------------------------------- main



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="whole runs, each a fresh set of ranks (3)")
    parser.add_argument("--calls", type=int, default=200, help="calls for fabriclite, the floors and the limit")
    parser.add_argument("--big-calls", type=int, default=40, help="the same for the 16M-float cases")
    parser.add_argument("--keep-window", type=int, default=16, help="timed calls per keep window")
    parser.add_argument("--big-keep-window", type=int, default=2, help="the same for the 16M-float cases")
    parser.add_argument("--budget", type=float, default=5.0, help="seconds per baseline and size")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="gloo: CPU ranks; nccl: one rank per GPU")
    parser.add_argument("--ranks", type=int, default=None, help="ranks (gloo: 2; nccl: every GPU)")
    parser.add_argument("--results", default=None,
                        help="the results file (benchmarks/results/collectives.md; _nccl with nccl)")
    parser.add_argument("--plot", default=None, help="write the plot (PNG) here")
    parser.add_argument("--reduce-op", default="mean", help="all_reduce's op for fabriclite and Lightning Fabric")
    parser.add_argument("--only", default=None, help="only the cases whose 'op label' contains this, or one of these comma-separated "
                        "parts ('all_reduce 1 x 0-d,all_gather 1000 x')")
    parser.add_argument("--no-baselines", action="store_true", help="leave Lightning Fabric and the loop out")
    parser.add_argument("--baselines-up-to", type=int, default=1000,
                        help="leaves up to which Lightning Fabric and the loop run (16M: always)")
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="also write every run's raw numbers here")
    args = parser.parse_args()
    if os.environ.get("FABRICLITE_BENCH_WORKER"):
        worker(args)
        return
    results = Results("collectives" if args.backend == "gloo" else "collectives_nccl")
    ranks = args.ranks
    if ranks is None:
        ranks = 2
        if args.backend == "nccl":
            import torch

            ranks = torch.cuda.device_count()
    if ranks < 1:
        parser.error(f"--ranks {ranks}: needs at least 1 (nccl: one rank per GPU, and no GPU was found)")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.runs):
            out = os.path.join(tmp, f"run{r}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                   os.path.abspath(__file__), *sys.argv[1:], "--out", out]
            env = clean_env({"FABRICLITE_BENCH_WORKER": "1", "OMP_NUM_THREADS": "1",
                             "FABRICLITE_BENCH_PROFILE": "1" if r == 0 else "0"})
            print(f"run {r + 1} of {args.runs}", file=sys.stderr, flush=True)
            subprocess.run(cmd, env=env, check=True)
            with open(out) as f:
                runs.append(json.load(f))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f)
    tables, goals, missed = report(runs)
    print(tables + "\n\n" + "\n".join(goals))
    plot = args.plot if args.plot and write_plot(args.plot, runs) else None
    write_results(args.results, results, tables, goals, missed, runs, plot)


if __name__ == "__main__":
    main()
