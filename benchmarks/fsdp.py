"""Sharded training's memory per rank, each implementation in its own processes: fabriclite's fsdp, Lightning's
ModelParallel strategy (its FSDPStrategy refuses CPU), hand-written FSDP2, and fabriclite's ddp (unsharded, for
reference), on 2 CPU ranks, on a stack of pre-norm MLP blocks at two sizes.

Every (implementation, size) is a fresh 2-rank job (torchrun), so a rank's memory is its own: nothing another
implementation allocated is counted. Each rank records, from the OS (``/proc/self/status``):

- RSS at the start (torch, the framework and torch.distributed's fsdp, tensor and checkpoint modules imported),
  the peak during set-up (the Fabric and its process group where there is one, building the model, sharding,
  materialising, the optimizer) and the peak during training (a warm-up step and ``--steps`` timed steps): the
  peak is ``VmHWM``, reset before each phase (``/proc/self/clear_refs``);

and, in tensors, the bytes of this rank's parameters, gradients and optimizer state after a step: the storages
they live in, each counted once (a DTensor's local shard; FSDP1's flat parameter), summed by this benchmark from
the objects themselves. Set-up comes in two forms where the implementation has both: **meta init** (the model
built on the meta device and materialised shard by shard: ``fabric.init_module(empty_init=True)``, ``with
torch.device("meta")`` by hand) and **materialize then shard** (built whole on every rank first). Step time is
the median of the timed steps (the slower rank's); jobs run one after another, so the machine's load moves it.

    python benchmarks/fsdp.py [--steps 3] [--sizes small,large] [--only SUBSTRING] [--plot docs/fsdp_benchmark.png]

writes benchmarks/results/fsdp.md (``--results PATH`` elsewhere). The plot needs matplotlib (the bench extra).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Results, clean_env, table  # noqa: E402

SIZES = {"small": (256, 2), "large": (768, 4)}  # width, blocks
BATCH, SEQ = 8, 32
IMPLS = ("fabriclite fsdp, meta init", "fabriclite fsdp, materialize then shard", "Lightning FSDP, meta init",
         "Lightning FSDP, materialize then shard", "Lightning ModelParallel, meta init", "FSDP2 by hand, meta init",
         "FSDP2 by hand, materialize then shard", "fabriclite ddp (unsharded)")


def _blocks() -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: Any) -> Any:
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    def build(width: int, depth: int) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[Block(width) for _ in range(depth)], nn.LayerNorm(width), nn.Linear(width, width))
    return Block, build


# ---------------------------------------------------------------------------------------------- in a rank
def _status(field: str) -> float:
    """``field`` of /proc/self/status in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def tensor_bytes(model: Any, optimizer: Any) -> Dict[str, int]:
    """This rank's bytes in parameters, gradients and optimizer state: each storage counted once."""
    import torch

    seen: set = set()

    def size(t: Any) -> int:
        if t is None or not isinstance(t, torch.Tensor):
            return 0
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        if storage.data_ptr() in seen or local.device.type == "meta":
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    params = list(model.parameters())
    out = {"params": sum(size(p) for p in params), "grads": sum(size(p.grad) for p in params)}
    out["optimizer"] = sum(size(v) for state in optimizer.state.values() for v in state.values())
    return out


def _prepare(impl: str, width: int, depth: int) -> Tuple[Any, Any, Callable[[Any], None]]:
    """(model, optimizer, step) for ``impl``: everything a user writes before the first step."""
    import torch

    Block, build = _blocks()
    meta = "meta init" in impl
    if impl.startswith("FSDP2 by hand"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if meta:
            with torch.device("meta"):
                model = build(width, depth)
        else:
            model = build(width, depth)
        for block in [m for m in model if isinstance(m, Block)]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if meta:
            model.to_empty(device="cpu")
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x: Any) -> None:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        return model, opt, step
    if impl.startswith("fabriclite"):
        from fabriclite import Fabric
        from fabriclite.strategies import FSDPStrategy

        strategy: Any = "ddp" if "ddp" in impl else FSDPStrategy(auto_wrap_policy={Block})
    else:
        sys.modules.setdefault("mpi4py", None)  # type: ignore[arg-type]  # Lightning's MPI probe would MPI_Init
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import FSDPStrategy as LFSDP, ModelParallelStrategy

        def shard(model: Any, mesh: Any) -> Any:
            from torch.distributed.fsdp import fully_shard

            for block in [m for m in model if isinstance(m, Block)]:
                fully_shard(block, mesh=mesh["data_parallel"])
            return fully_shard(model, mesh=mesh["data_parallel"])
        world = int(os.environ["WORLD_SIZE"])  # all ranks data-parallel ("auto" puts them on tensor-parallel)
        strategy = LFSDP(auto_wrap_policy={Block}) if "FSDP" in impl else \
            ModelParallelStrategy(shard, data_parallel_size=world, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy)
    fabric.launch()
    with fabric.init_module(empty_init=meta):
        model = build(width, depth)
    if "ModelParallel" in impl:  # Lightning's order for it: the module first, then the optimizer on its shards
        model = fabric.setup_module(model)
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4))
    else:
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(x: Any) -> None:
        opt.zero_grad()
        fabric.backward(model(x).pow(2).mean())
        opt.step()
    return model, opt, step


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    width, depth = SIZES[args.worker_size]
    if args.worker_impl.startswith("FSDP2"):
        dist.init_process_group("gloo")
    elif args.worker_impl.startswith("fabriclite"):
        import fabriclite  # noqa: F401  # imports are not set-up: loaded before the start is read
    else:
        sys.modules.setdefault("mpi4py", None)  # type: ignore[arg-type]
        import lightning.fabric  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401  # what every implementation imports lazily, loaded before
    import torch.distributed.fsdp  # noqa: F401  # the start is read: set-up peaks are then the model's
    import torch.distributed.tensor  # noqa: F401
    start = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    model, opt, step = _prepare(args.worker_impl, width, depth)
    setup_s = time.perf_counter() - t0
    facts: Dict[str, Any] = {"start_mib": start, "setup_peak_mib": _status("VmHWM"), "setup_s": setup_s}
    rank = dist.get_rank()
    x = torch.randn(BATCH, SEQ, width, generator=torch.Generator().manual_seed(rank))
    _reset_peak()
    step(x)  # warm-up: optimizer state allocated
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t = time.perf_counter()
        step(x)
        times.append(time.perf_counter() - t)
    facts.update(train_peak_mib=_status("VmHWM"), step_s=statistics.median(times), tensors=tensor_bytes(model, opt))
    with open(os.path.join(args.worker_out, f"rank{rank}.json"), "w") as f:
        json.dump(facts, f)
    dist.barrier()


# ---------------------------------------------------------------------------------------------- driver



def run_job(impl: str, size: str, steps: int) -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               os.path.abspath(__file__), "--worker-impl", impl,
               "--worker-size", size, "--worker-out", out, "--steps", str(steps)]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = clean_env({"OMP_NUM_THREADS": "1",
                         "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))})
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{impl} / {size} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def _params(size: str) -> int:
    width, depth = SIZES[size]
    return depth * (8 * width * width + 7 * width) + width * width + 3 * width


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--only", default=None, help="only the implementations whose name contains this")
    parser.add_argument("--results", default=None, help="the results file (benchmarks/results/fsdp.md)")
    parser.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--worker-impl", help=argparse.SUPPRESS)
    parser.add_argument("--worker-size", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_impl:
        worker(args)
        return
    results = Results("fsdp")
    # Lightning's FSDPStrategy refuses CPU ("FSDP is only available on GPU"): its rows need a GPU
    impls = [i for i in IMPLS if (not args.only or args.only in i) and not i.startswith("Lightning FSDP")]
    rows, measured = [], {}
    for size in args.sizes.split(","):
        for impl in impls:
            print(f"{size}: {impl}", file=sys.stderr, flush=True)
            ranks = run_job(impl, size, args.steps)
            measured[(size, impl)] = ranks

            def both(fn: Callable[[Dict[str, Any]], float], fmt: str = "{:.0f}") -> str:
                return " / ".join(fmt.format(fn(r)) for r in ranks)
            tensors = [sum(r["tensors"].values()) / 2**20 for r in ranks]
            rows.append([size, f"{_params(size):,}", impl, both(lambda r: r["start_mib"]),
                         both(lambda r: r["setup_peak_mib"] - r["start_mib"]),
                         both(lambda r: r["train_peak_mib"] - r["start_mib"]),
                         " / ".join(f"{t:.1f}" for t in tensors),
                         f"{max(r['step_s'] for r in ranks) * 1e3:.0f} ms"])
    headers = ["size", "params", "implementation", "RSS at start, MiB (r0 / r1)", "set-up peak above start, MiB",
               "training peak above start, MiB", "params+grads+optimizer, MiB (r0 / r1)", "step (median, slower rank)"]
    body = (f"2 CPU ranks (gloo), batch {BATCH}x{SEQ}, AdamW; each row a fresh 2-rank job; Lightning's FSDPStrategy "
            f"is left out (it refuses CPU: \"FSDP is only available on GPU\"); peaks from the OS "
            f"(VmHWM, reset before each phase), above the rank's RSS at the start; tensors summed from the objects "
            f"after {args.steps + 1} steps.\n\n" + table(headers, rows) + "\n")
    print(body)
    if args.plot:
        _plot(measured, args.plot)
        body += f"\n![memory per rank]({os.path.relpath(args.plot, os.path.dirname(results.path(args.results)))})\n"
    results.write(body, path=args.results)


def _plot(measured: Dict[Tuple[str, str], List[Dict[str, Any]]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    sizes = sorted({s for s, _ in measured}, key=list(SIZES).index)
    impls = [i for i in IMPLS if any(i == m for _, m in measured)]
    fig, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        ys = range(len(impls))
        setup = [max(r["setup_peak_mib"] - r["start_mib"] for r in measured[(size, i)]) for i in impls]
        train = [max(r["train_peak_mib"] - r["start_mib"] for r in measured[(size, i)]) for i in impls]
        ax.barh([y - 0.2 for y in ys], setup, height=0.4, label="set-up peak")
        ax.barh([y + 0.2 for y in ys], train, height=0.4, label="training peak")
        ax.set_yticks(list(ys), impls, fontsize=7)
        ax.set_xlabel("MiB above the rank's start (larger rank)")
        ax.set_title(f"{size} ({_params(size):,} parameters)")
        ax.legend(fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
