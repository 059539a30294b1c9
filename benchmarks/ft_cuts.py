"""Where `--fault-tolerant`'s per-step cost goes, cut by cut (issue 28): 3 local replica groups x 1 CPU rank on the
ft lane's model and loop (as ``BY_HAND`` in benchmarks/fault_tolerance.py: the 16-W-W-1 MLP, SGD, one quorum and
commit a step), each variant run in turn, interleaved, ``--repeats`` times; ms per step (group 0, after 20
warm-up steps), medians, and the time spent in each part of the step. Variants:

- ``ddp``: plain torch DDP on one gloo group of 3 (the anchor);
- ``hand``: torchft 0.2.0 by hand (its Manager, DDP and optimizer wrappers; the floor the issue names);
- ``fl``: fabriclite's parts (fabriclite/strategies/torchft/replica_parts.py: ReplicaManager, ReplicaDDP,
  ReplicaOptimizer) with every cut;
- ``fl-commit`` / ``fl-hook`` / ``fl-buckets``: ``fl`` less one cut (torchft's ``should_commit`` round trip to the
  group's ManagerServer; torchft's comm hook, its managed work, futures and timeouts, waited inside the hook;
  torchft's DDP buckets);
- ``fl+sync`` / ``fl+heartbeat`` / ``fl+tokio1`` / ``fl+switch``: ``fl`` plus one more setting that was tried
  (no asynchronous quorum; heartbeats every 500 ms instead of 100 ms; TOKIO_WORKER_THREADS=1 for torchft's Rust
  runtime; ``sys.setswitchinterval(0.0005)``).

    $(bash scripts/backend_env.sh ft --path)/bin/python benchmarks/ft_cuts.py --size tiny --repeats 5 \\
        --variants ddp,hand,fl,fl-commit,fl-hook,fl-buckets

It prints a markdown table and writes it to benchmarks/results/ft_cuts_<size>.md (the per-cut figures quoted in
benchmarks/results/fault_tolerance.md's notes name the run they came from).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import Results  # noqa: E402
from fault_tolerance import run_groups, start_lighthouse  # noqa: E402

RANK = r"""
import os, sys, time
from datetime import timedelta
variant = sys.argv[5]
if variant == "fl+switch":
    sys.setswitchinterval(0.0005)
import torch, torch._dynamo
from torch import nn
import torch.distributed as dist
from torch.distributed import TCPStore

group, lighthouse, steps, skip, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[6]
width, batch = int(os.environ.get("FT_WIDTH", "32")), int(os.environ.get("FT_BATCH", "32"))
torch.manual_seed(1234 + group)
model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
state = {"step": 0}
if variant == "ddp":
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=group, world_size=3)
    ddp, opt = nn.parallel.DistributedDataParallel(model), optimizer
    current = lambda: state["step"]
else:
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    kw = dict(pg=pg, load_state_dict=lambda d: (model.load_state_dict(d["model"]), optimizer.load_state_dict(d["opt"])),
              state_dict=lambda: {"model": model.state_dict(), "opt": optimizer.state_dict()}, min_replica_size=1,
              use_async_quorum=variant != "fl+sync", timeout=timedelta(seconds=30),
              quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=30), rank=0, world_size=1,
              store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=f"http://{lighthouse}",
              replica_id=f"group_{group}", hostname="127.0.0.1",
              checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=30), device=torch.device("cpu")),
              init_sync=True)
    if variant == "fl+heartbeat":
        kw["heartbeat_interval"] = timedelta(milliseconds=500)
    if variant == "hand":
        from torchft.ddp import DistributedDataParallel
        from torchft.optim import OptimizerWrapper
        manager = Manager(**kw)
        ddp, opt = DistributedDataParallel(manager, model), OptimizerWrapper(manager, optimizer)
    else:
        from fabriclite.strategies.torchft import replica_parts as parts
        from torchft.ddp import DistributedDataParallel
        if variant == "fl-commit":
            parts.ReplicaManager.should_commit = Manager.should_commit
        if variant == "fl-hook":
            def torchft_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
                work = state.allreduce(bucket.buffer())  # torchft's managed all-reduce, waited in the hook
                work.wait()
                inner = getattr(work.get_future(), "_fut", None)
                if inner is None:
                    inner = torch.futures.Future()
                    inner.set_result(bucket.buffer())
                return inner
            parts.ReplicaDDP._comm_hook = staticmethod(torchft_hook)
        if variant == "fl-buckets":
            parts.plain_bucket_caps = lambda module: None
        manager = parts.ReplicaManager(**kw)
        ddp = parts.ReplicaDDP(manager, model)
        opt = parts.ReplicaOptimizer(manager, optimizer, manager.start_quorum)
    current = manager.current_step
parts_s = {"zero_grad": 0.0, "forward": 0.0, "backward": 0.0, "step": 0.0}
clock = time.perf_counter
times = []
while current() < steps:
    t0 = clock()
    opt.zero_grad()
    t1 = clock()
    gen = torch.Generator().manual_seed(100_000 * group + state["step"])
    x = torch.randn(batch, 16, generator=gen)
    loss = ((ddp(x) - x.sum(1, keepdim=True).tanh()) ** 2).mean()
    t2 = clock()
    loss.backward()
    t3 = clock()
    opt.step()
    t4 = clock()
    state["step"] = state["step"] + 1 if variant == "ddp" else manager.current_step()
    times.append(time.time())
    if len(times) > skip:
        for k, a, b in (("zero_grad", t0, t1), ("forward", t1, t2), ("backward", t2, t3), ("step", t3, t4)):
            parts_s[k] += b - a
n = len(times) - skip
times = times[skip:]
print(f"RATE {(len(times) - 1) / (times[-1] - times[0]):.4f} "
      + " ".join(f"{k}={v / n * 1e3:.3f}" for k, v in parts_s.items()), flush=True)
if variant != "ddp":
    manager.shutdown(wait=False)
os._exit(0)
"""
VARIANTS = ("ddp", "hand", "fl", "fl-commit", "fl-hook", "fl-buckets", "fl+sync", "fl+heartbeat", "fl+tokio1",
            "fl+switch")
PARTS = ("zero_grad", "forward", "backward", "step")


def free_port() -> int:
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(variant: str, env: Dict[str, str], steps: int) -> Tuple[float, Dict[str, float]]:
    """One job of 3 groups: group 0's ms per step and ms per part of the step."""
    port = free_port()
    house = start_lighthouse(port) if variant != "ddp" else None
    full = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn", "PYTHONPATH": str(ROOT), **env}
    if variant == "fl+tokio1":
        full["TOKIO_WORKER_THREADS"] = "1"
    outs = run_groups(RANK, [[str(g), f"127.0.0.1:{port}", str(steps), "20", variant, str(port)] for g in range(3)],
                      full, house)
    found = re.search(r"RATE ([\d.]+) (.*)", outs[0])
    assert found, outs[0][-2000:]
    return 1e3 / float(found.group(1)), {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", found.group(2))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=("tiny", "big"), default="tiny",
                        help="tiny: 16-32-32-1, batch 32, 300 steps; big: 16-1024-1024-1, batch 512, 100 steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="ddp,hand,fl,fl-commit,fl-hook,fl-buckets")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    env, steps = ({"FT_WIDTH": "1024", "FT_BATCH": "512"}, 100) if args.size == "big" else ({}, 300)
    results = Results(f"ft_cuts_{args.size}")
    ms: Dict[str, List[float]] = {v: [] for v in variants}
    parts: Dict[str, List[Dict[str, float]]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            step_ms, p = run(v, env, steps)
            ms[v].append(step_ms)
            parts[v].append(p)
            print(f"{v:13s} {step_ms:8.2f} ms/step  " + " ".join(f"{k}={p[k]:.2f}" for k in PARTS), flush=True)
    med = statistics.median
    anchor = med(ms["ddp"]) if "ddp" in ms else None
    lines = [f"ms per step of group 0, median of {args.repeats} interleaved runs (the runs' range), and each part's "
             "median (ms)", "", "| variant | ms/step (range) | over ddp | " + " | ".join(PARTS) + " |",
             "|---|---|---|" + "---|" * len(PARTS)]
    for v in variants:
        over = f"{med(ms[v]) - anchor:+.2f}" if anchor is not None and v != "ddp" else ""
        lines.append(f"| {v} | {med(ms[v]):.2f} ({min(ms[v]):.2f}-{max(ms[v]):.2f}) | {over} | "
                     + " | ".join(f"{med([p[k] for p in parts[v]]):.2f}" for k in PARTS) + " |")
    body = "\n".join(lines)
    print(body)
    model = "16-1024-1024-1, batch 512, 100 steps" if args.size == "big" else "16-32-32-1, batch 32, 300 steps"
    results.write(body, extra=[("interpreter", "the ft lane's: `$(bash scripts/backend_env.sh ft --path)/bin/python`"),
                               ("torchft", "0.2.0"), ("model", model)])


if __name__ == "__main__":
    main()
