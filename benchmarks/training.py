"""Training throughput (steps/s) of the example model: fabriclite vs Lightning Fabric vs hand-written DDP.

Every run is a fresh 2-rank CPU job (gloo) training ``examples/train.py``'s model on synthetic data with the
same loop: set-up data loader (DistributedSampler, shuffled), forward, cross-entropy, backward, AdamW step.
Rank 0 times ``--steps`` steps after ``--warmup`` steps, between two barriers. Runs are interleaved (round
robin, order rotated each round) and each framework's median over the rounds is reported, twice:

- "own defaults": no thread setting from outside (fabriclite and Lightning give each rank cores/ranks
  threads, plain torch uses all cores in every rank);
- "explicit": OMP_NUM_THREADS=<--threads> for all three.

    python benchmarks/training.py [--rounds 5] [--steps 1500] [--threads 1]

writes benchmarks/results/training.md (``--results PATH`` elsewhere).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

FRAMEWORKS = ("fabriclite", "lightning", "ddp")
RESULT = "BENCH-RESULT "


# ---------------------------------------------------------------------- workers (one 2-rank job each)
def _loop(model: Any, optimizer: Any, loader: Any, backward: Any, to_device: Any, steps: int, warmup: int,
          barrier: Any, set_epoch: Any = None) -> float:
    import torch.nn.functional as F

    done, epoch, start = 0, 0, 0.0
    while True:
        if set_epoch is not None:
            set_epoch(epoch)
        for batch in loader:
            x, y = to_device(batch)
            if done == warmup:
                barrier()
                start = time.perf_counter()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            backward(loss)
            optimizer.step()
            done += 1
            if done == warmup + steps:
                barrier()
                return steps / (time.perf_counter() - start)
        epoch += 1


def _data(samples: int) -> Any:
    from examples.train import synthetic_data

    return synthetic_data(samples, seed=1)


def worker_fabric(module: str, args: argparse.Namespace) -> None:
    import importlib

    import torch
    from torch.utils.data import DataLoader

    from examples.train import make_model

    Fabric = importlib.import_module(module).Fabric
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0)
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = fabric.setup_dataloaders(DataLoader(_data(args.samples), batch_size=args.batch_size, shuffle=True))
    import torch.distributed as dist

    rate = _loop(model, optimizer, loader, fabric.backward, lambda b: b, args.steps, args.warmup, dist.barrier)
    if fabric.global_rank == 0:
        print(RESULT + json.dumps({"steps_per_s": rate, "threads": torch.get_num_threads()}), flush=True)


def worker_ddp(args: argparse.Namespace) -> None:
    """Hand-written DDP: this process starts the two ranks (like torchrun) unless it is one."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, *sys.argv], env={
            **os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}) for r in range(2)]
        codes = [p.wait() for p in procs]
        if any(codes):
            sys.exit(max(codes))
        return
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from examples.train import make_model

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    device = torch.device("cpu")
    model = DistributedDataParallel(make_model().to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dataset = _data(args.samples)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    rate = _loop(model, optimizer, loader, lambda loss: loss.backward(),
                 lambda b: [t.to(device, non_blocking=True) for t in b], args.steps, args.warmup, dist.barrier,
                 set_epoch=sampler.set_epoch)
    if dist.get_rank() == 0:
        print(RESULT + json.dumps({"steps_per_s": rate, "threads": torch.get_num_threads()}), flush=True)
    dist.destroy_process_group()


# ---------------------------------------------------------------------- orchestration
def run_once(framework: str, args: argparse.Namespace, threads: int | None) -> Dict[str, Any]:
    from common import clean_env

    env = clean_env({"PYTHONPATH": os.path.dirname(HERE)})
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", framework, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--samples", str(args.samples), "--batch-size", str(args.batch_size)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if RESULT in line:
            return json.loads(line.split(RESULT, 1)[1])
    raise RuntimeError(f"{framework} run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=FRAMEWORKS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="the explicit thread count of the second pass")
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    parser.add_argument("--passes", default="own,explicit", help="which passes: own, explicit or both")
    parser.add_argument("--results", default=None, help="the results file (benchmarks/results/training.md)")
    args = parser.parse_args()
    if args.worker == "fabriclite":
        return worker_fabric("fabriclite", args)
    if args.worker == "lightning":
        # Lightning's MPI detection imports mpi4py and calls MPI_Init, which aborts on machines that have mpi4py
        # but no MPI launcher; this benchmark never runs under MPI, so hide mpi4py from it.
        sys.modules.setdefault("mpi4py", None)  # type: ignore[arg-type]
        return worker_fabric("lightning.fabric", args)
    if args.worker == "ddp":
        return worker_ddp(args)

    from common import Results, median, table

    results = Results("training")
    frameworks = [f for f in args.frameworks.split(",") if f]
    if "lightning" in frameworks:
        try:
            import lightning.fabric  # noqa: F401
        except ImportError:
            print("lightning is not installed (pip install 'fabriclite[bench]'); skipping it", file=sys.stderr)
            frameworks.remove("lightning")
    passes = {title: threads for key, title, threads in
              (("own", "own defaults", None), ("explicit", f"explicit OMP_NUM_THREADS={args.threads}", args.threads))
              if key in args.passes.split(",")}
    report = [f"Training steps/s, 2 CPU ranks (gloo), {args.rounds} interleaved rounds x {args.steps} steps (after "
              f"{args.warmup} warm-up), batch {args.batch_size}/rank; median per framework\n"]
    print(report[0])
    for title, threads in passes.items():
        rates: Dict[str, List[float]] = {f: [] for f in frameworks}
        used: Dict[str, int] = {}
        for r in range(args.rounds):
            order = frameworks[r % len(frameworks):] + frameworks[:r % len(frameworks)]
            for framework in order:
                result = run_once(framework, args, threads)
                rates[framework].append(result["steps_per_s"])
                used[framework] = result["threads"]
        base = median(rates["ddp"]) if "ddp" in rates else None
        rows = []
        for framework in frameworks:
            m = median(rates[framework])
            rows.append([framework, used[framework], f"{m:.1f} steps/s", f"{min(rates[framework]):.1f} steps/s",
                         f"{max(rates[framework]):.1f} steps/s", f"{m / base:.3f}x" if base else "-"])
        section = f"## {title}\n\n" + table(["framework", "threads/rank", "median steps/s", "min", "max",
                                              "vs hand-written DDP"], rows) + "\n"
        print(section, flush=True)
        report.append(section)
    results.write("\n".join(report), path=args.results)


if __name__ == "__main__":
    main()
