"""fsdp against ddp and hand-written FSDP2 on 2 CPU ranks, on a transformer-like stack at three sizes.

- step time: median over interleaved rounds (each round runs every implementation once per size, so drifting
  machine load hits all of them alike), with the load average recorded;
- counted bytes per rank: the rank's parameter, gradient and optimizer-state storages, padding included;
- RSS per rank after each configuration's steps (``VmRSS``) and the process's peak (``ru_maxrss``);
- the largest model each fits in a fixed per-rank budget of counted bytes (from the bytes per parameter measured).

fabriclite's fsdp runs ``FSDPStrategy(auto_wrap_policy={Block})``; hand-written FSDP2 is the same model and loop with
no fabriclite in it: ``fully_shard`` on each block and the root over the world group, ``loss.backward()``, ``clip_grad_norm_``, ``optimizer.step()``.

    python benchmarks/fsdp.py [--rounds 5] [--steps 4] [--markdown docs/fsdp_benchmark.md] [--plot docs/fsdp_benchmark.png]

The plot needs matplotlib; without it only the table is written.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import warnings
from typing import Any, Dict, List

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from common import table  # noqa: E402

SIZES = {"small": (96, 2), "medium": (192, 4), "large": (384, 4)}  # width, blocks
BATCH, SEQ = 8, 32
BUDGET = 64 << 20  # counted bytes per rank
IMPLS = ("fsdp", "ddp", "fsdp2-by-hand")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.LayerNorm(width), nn.Linear(width, width))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def prepare(impl: str, fabric: Any, fsdp: Any, width: int, depth: int):
    """(model, optimizer, step function) for one implementation."""
    from fabriclite.strategies.fsdp2 import counted_bytes

    model = build(width, depth)
    if impl == "fsdp2-by-hand":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (fabric.world_size,))
        for block in [m for m in model if isinstance(m, Block)]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(x):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return step, lambda: counted_bytes(model, [opt])
    runner = fsdp if impl == "fsdp" else fabric
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wrapped, wopt = runner.setup(model, opt)

    def step(x):
        wopt.zero_grad()
        loss = wrapped(x).pow(2).mean()
        runner.backward(loss)
        runner.clip_gradients(wrapped, wopt, max_norm=1.0)
        wopt.step()
    inner = wrapped._forward_module
    return step, lambda: counted_bytes(getattr(inner, "module", inner), [opt])


def worker(fabric: Any, rounds: int, steps: int) -> Dict[str, Any]:
    from fabriclite import Fabric

    warnings.filterwarnings("ignore", message=".*returned a view tensor")  # the last Linear's output on 3-D input
    from fabriclite.strategies import FSDPStrategy

    fsdp = Fabric(accelerator="cpu", devices=fabric.world_size, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fsdp.launch()
    torch.set_num_threads(1)
    x = torch.randn(BATCH, SEQ, 1, generator=torch.Generator().manual_seed(fabric.global_rank))
    times: Dict[str, List[float]] = {}
    facts: Dict[str, Dict[str, float]] = {}
    prepared = {}
    for name, (width, depth) in SIZES.items():
        inputs = x.expand(BATCH, SEQ, width).contiguous()
        for impl in IMPLS:
            step, count = prepare(impl, fabric, fsdp, width, depth)
            step(inputs)  # warm-up: optimizer state allocated, first all-gathers done
            params = sum(p.numel() for p in build(width, depth).parameters())
            facts[f"{name}/{impl}"] = {"counted": count(), "params": params, "rss_mb": rss_mb()}
            prepared[(name, impl)] = (step, inputs)
    for _ in range(rounds):
        for (name, impl), (step, inputs) in prepared.items():
            fabric.barrier()
            t = time.perf_counter()
            for _ in range(steps):
                step(inputs)
            fabric.barrier()
            times.setdefault(f"{name}/{impl}", []).append((time.perf_counter() - t) / steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"times": times, "facts": facts, "peak_rss_mb": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--plot", default=None, help="write a PNG plot here (needs matplotlib)")
    args = parser.parse_args()
    from fabriclite import Fabric

    load_before = os.getloadavg()
    started = time.time()
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn")
    results = fabric.launch(_all_ranks, args.rounds, args.steps)
    elapsed = time.time() - started
    load_after = os.getloadavg()
    rows = []
    for name in SIZES:
        hand = max(statistics.median(r["times"][f"{name}/fsdp2-by-hand"]) for r in results)
        for impl in IMPLS:
            key = f"{name}/{impl}"
            med = max(statistics.median(r["times"][key]) for r in results)
            facts = results[0]["facts"][key]
            per_param = facts["counted"] / facts["params"]
            rows.append([name, f"{facts['params']:,}", impl, f"{med * 1e3:.1f}", f"{med / hand:.2f}",
                         f"{facts['counted'] / 2**20:.2f}", " / ".join(f"{r['facts'][key]['rss_mb']:.0f}" for r in results),
                         f"{BUDGET / per_param / 1e6:.1f}M"])
    headers = ["size", "params", "implementation", "step ms (median)", "vs by-hand", "counted MiB/rank",
               "RSS MiB r0 / r1", f"largest in {BUDGET >> 20} MiB/rank"]
    text = table(headers, rows)
    peaks = " / ".join(f"{r['peak_rss_mb']:.0f}" for r in results)
    footer = (f"\n\n2 CPU ranks (gloo), batch {BATCH}x{SEQ}, {args.rounds} interleaved rounds x {args.steps} steps; "
              f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; peak RSS per rank "
              f"{peaks} MiB; {elapsed:.0f} s in all.")
    print(text + footer)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + footer + "\n")
    if args.plot:
        _plot(rows, args.plot)
    print(json.dumps({"load": [load_before, load_after], "elapsed_s": elapsed}))


def _all_ranks(fabric: Any, rounds: int, steps: int) -> List[Dict[str, Any]]:
    return fabric.strategy.all_gather_object(worker(fabric, rounds, steps))


def _plot(rows: List[List[str]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for impl in IMPLS:
        mine = [r for r in rows if r[2] == impl]
        sizes = [r[0] for r in mine]
        ax1.plot(sizes, [float(r[3]) for r in mine], marker="o", label=impl)
        ax2.plot(sizes, [float(r[5]) for r in mine], marker="o", label=impl)
    ax1.set_ylabel("step time, ms (median)")
    ax2.set_ylabel("counted MiB per rank")
    for ax in (ax1, ax2):
        ax.set_xlabel("model size")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("fsdp vs ddp vs hand-written FSDP2, 2 CPU ranks")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
