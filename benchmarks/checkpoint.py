"""Checkpoint saves that do not stall training: synchronous vs asynchronous, ddp and fsdp, 2 CPU ranks, same run.

    python benchmarks/checkpoint.py [--width 2560] [--layers 8] [--steps 12] [--every 4] \
        [--out benchmarks/results/checkpoint.md]

A model of ``layers`` x Linear(width, width) (default 8 x 2560: 52.5 M parameters) trains with AdamW on 2 CPU ranks
(``ddp_spawn``, gloo), saving every ``every`` steps into a fresh directory. The configurations run one after the other
in the same processes, each from the same initial weights and data:

- fabriclite ddp, sync: ``fabric.save(..., keep=2)`` with the default TorchCheckpointIO (atomic; manifest, sha256)
- fabriclite ddp, async: the same with ``plugins=[AsyncCheckpointIO()]``
- Lightning ddp (peer): what ``lightning.fabric``'s DDPStrategy.save_checkpoint does: state_dicts, global rank 0
  calls Lightning's ``TorchCheckpointIO.save_checkpoint``, then a barrier (no manifest, no checksum)
- fabriclite fsdp, sync / async: ``FSDPStrategy(state_dict_type="sharded"[, async_save=True])``, ``keep=2``
- DCP by hand (floor): ``get_state_dict`` + ``torch.distributed.checkpoint.save`` / ``async_save`` (its own gloo
  group; the previous future waited before the next save and at the end)

Per configuration (the slower rank counts): the **save call**, how long one save blocks the training loop (median
over the saves); the **stall per save**, (wall time of the steps with saves, the wait for the last save at the end
included, minus the mean wall time of as many steps without saves, run before and after) / saves: what the saves
cost the run, background work competing for the CPU included; **snapshot**: the bytes an asynchronous save copies on the rank that copies
most, and the peak RSS rise over the run's starting RSS on that rank (sampled every 5 ms); **final weights**: sha256
of the full weights after the last step (every configuration of one strategy must give the same). Ratios: the
asynchronous stall against the synchronous save call of the same strategy (the goal: <= 0.15).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Results, table  # noqa: E402

CONFIGS = ("fabriclite ddp sync", "fabriclite ddp async", "Lightning ddp (peer)", "fabriclite fsdp sync",
           "fabriclite fsdp async", "DCP by hand sync", "DCP by hand async")
BATCH = 16


def build(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """The highest RSS seen by a sampling thread (every 5 ms) while it runs."""

    def __init__(self) -> None:
        self.peak, self._stop = rss_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> "PeakRSS":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def digest(state: Dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def prepare(config: str, fabric: Any, width: int, layers: int, root: str) -> Tuple[Callable, Callable, Callable,
                                                                                    Callable, Callable]:
    """``(step, save(n), finish, snapshot_bytes, full_weights)`` of one configuration."""
    from fabriclite import Fabric
    from fabriclite.plugins.io import AsyncCheckpointIO
    from fabriclite.strategies import FSDPStrategy

    strategy: Any = "ddp"
    plugins = None
    if "fsdp" in config or "DCP" in config:
        strategy = FSDPStrategy(async_save=config == "fabriclite fsdp async")
    elif config == "fabriclite ddp async":
        plugins = [AsyncCheckpointIO()]
    run = Fabric(accelerator="cpu", devices=fabric.world_size, strategy=strategy, plugins=plugins)
    run.launch()
    model = build(width, layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = run.setup(model, optimizer)
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(run.global_rank))

    def step() -> None:
        optimizer.zero_grad()
        run.backward(model(x).pow(2).mean())
        optimizer.step()

    def full_weights() -> Dict[str, torch.Tensor]:
        return run.strategy.get_module_state_dict(model._forward_module if hasattr(model, "_forward_module")
                                                  else model)

    state = {"model": model, "optimizer": optimizer, "step": 0}
    if config.startswith("fabriclite"):
        def save(n: int) -> None:
            state["step"] = n
            run.save(os.path.join(root, f"step-{n:04d}.ckpt"), state, keep=2)

        def snapshot_bytes() -> int:
            if not config.endswith("async"):
                return 0
            if "fsdp" in config:
                from torch.distributed.checkpoint.state_dict import get_state_dict

                return tensor_bytes(get_state_dict(model._forward_module, optimizer.optimizer))
            return tensor_bytes({"m": model._forward_module.module.state_dict(),
                                 "o": optimizer.optimizer.state_dict()}) if run.is_global_zero else 0

        return step, save, run.strategy.wait_for_checkpoints, snapshot_bytes, full_weights
    if config == "Lightning ddp (peer)":
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        io = TorchCheckpointIO()

        def save(n: int) -> None:  # lightning.fabric's Strategy.save_checkpoint, then Fabric.save's barrier
            checkpoint = {"model": model._forward_module.module.state_dict(),
                          "optimizer": optimizer.optimizer.state_dict(), "step": n}
            if run.is_global_zero:
                io.save_checkpoint(checkpoint, os.path.join(root, f"step-{n:04d}.ckpt"))
            run.barrier()

        return step, save, lambda: None, lambda: 0, full_weights
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    pending: List[Any] = []
    group = torch.distributed.new_group(backend="gloo") if config.endswith("async") else None

    def save(n: int) -> None:
        msd, osd = get_state_dict(model._forward_module, optimizer.optimizer)
        path = os.path.join(root, f"step-{n:04d}")
        if group is None:
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)
            return
        if pending:
            pending.pop().result()
        pending.append(dcp.async_save({"model": msd, "optimizer": osd}, checkpoint_id=path, process_group=group))

    def finish() -> None:
        if pending:
            pending.pop().result()

    def snapshot_bytes() -> int:
        return tensor_bytes(get_state_dict(model._forward_module, optimizer.optimizer)) if group is not None else 0

    return step, save, finish, snapshot_bytes, full_weights


def measure(config: str, fabric: Any, width: int, layers: int, steps: int, every: int) -> Dict[str, Any]:
    root = fabric.broadcast(tempfile.mkdtemp(prefix="fabriclite-ckpt-bench-") if fabric.is_global_zero else None)
    try:
        step, save, finish, snapshot_bytes, full_weights = prepare(config, fabric, width, layers, root)
        step()  # warm-up: optimizer state allocated
        snapshot = snapshot_bytes()
        calls: List[float] = []
        without = [steps_without_saves(fabric, step, steps)]  # before and after: drifting load hits both alike
        fabric.barrier()
        start_rss = rss_bytes()
        with PeakRSS() as peak:
            began = time.perf_counter()
            for n in range(1, steps + 1):
                step()
                if n % every == 0:
                    t = time.perf_counter()
                    save(n)
                    calls.append(time.perf_counter() - t)
            finish()
            with_saves = time.perf_counter() - began
        fabric.barrier()
        weights = digest(full_weights())
        without.append(steps_without_saves(fabric, step, steps))
        return {"calls": calls, "with": with_saves, "without": statistics.mean(without), "snapshot": snapshot,
                "rss_rise": peak.peak - start_rss, "weights": weights}
    finally:
        fabric.barrier()
        if fabric.is_global_zero:
            shutil.rmtree(root, ignore_errors=True)


def steps_without_saves(fabric: Any, step: Callable[[], None], steps: int) -> float:
    fabric.barrier()
    began = time.perf_counter()
    for _ in range(steps):
        step()
    fabric.barrier()
    return time.perf_counter() - began


def worker(fabric: Any, width: int, layers: int, steps: int, every: int, configs: List[str]) -> List[Dict[str, Any]]:
    """Every rank's measurements (rank 0 returns them all)."""
    torch.set_num_threads(1)
    mine = {config: measure(config, fabric, width, layers, steps, every) for config in configs}
    return fabric.strategy.all_gather_object(mine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "checkpoint.md"))
    args = parser.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    from fabriclite import Fabric

    params = sum(p.numel() for p in build(args.width, args.layers).parameters())
    results = Results("checkpoint")
    per_rank = Fabric(accelerator="cpu", devices=2, strategy="ddp_spawn").launch(
        worker, args.width, args.layers, args.steps, args.every, configs)
    body = render(per_rank, configs, args)
    print(body)
    saves = args.steps // args.every
    results.write(body, extra=[("cpu", cpu_model()), ("model", f"{args.layers} x Linear({args.width}, {args.width}), "
                                                               f"{params / 1e6:.1f} M parameters, AdamW; 2 CPU ranks "
                                                               f"(gloo), batch {BATCH}; {args.steps} steps, a save "
                                                               f"every {args.every} ({saves} saves)")],
                  path=args.out)


SYNC_OF = {"fabriclite ddp async": "fabriclite ddp sync", "fabriclite fsdp async": "fabriclite fsdp sync",
           "DCP by hand async": "DCP by hand sync"}


def render(per_rank: List[Dict[str, Any]], configs: List[str], args: Any) -> str:
    saves = args.steps // args.every
    facts: Dict[str, Dict[str, float]] = {}
    for config in configs:
        ranks = [r[config] for r in per_rank]
        facts[config] = {
            "call": max(statistics.median(r["calls"]) for r in ranks),
            "stall": max((r["with"] - r["without"]) / saves for r in ranks),
            "step": max(r["without"] / args.steps for r in ranks),
            "snapshot": max(r["snapshot"] for r in ranks),
            "rss": max(r["rss_rise"] for r in ranks),
        }
    rows = []
    for config in configs:
        f = facts[config]
        sync = SYNC_OF.get(config)
        ratio = f"{f['stall'] / facts[sync]['call']:.2f}" if sync in facts else "-"
        snapshot = f"{f['snapshot'] / 2**20:.0f}" if f["snapshot"] else "-"
        rows.append([config, f"{f['step'] * 1e3:.0f}", f"{f['call'] * 1e3:.0f}", f"{f['stall'] * 1e3:.0f}", ratio,
                     snapshot, f"{f['rss'] / 2**20:.0f}", per_rank[0][config]["weights"]])
    headers = ["configuration", "step ms", "save call ms", "stall per save ms", "stall / sync save call",
               "snapshot MiB", "peak RSS rise MiB", "final weights (sha256)"]
    peers = []
    if "fabriclite ddp sync" in facts and "Lightning ddp (peer)" in facts:
        peers.append(f"fabriclite ddp sync save call / Lightning's: "
                     f"{facts['fabriclite ddp sync']['call'] / facts['Lightning ddp (peer)']['call']:.2f}")
    if "fabriclite fsdp sync" in facts and "DCP by hand sync" in facts:
        peers.append(f"fabriclite fsdp sync save call / DCP by hand: "
                     f"{facts['fabriclite fsdp sync']['call'] / facts['DCP by hand sync']['call']:.2f}")
    for name, sync, run in (("ddp", "fabriclite ddp sync", "fabriclite ddp async"),
                            ("fsdp", "fabriclite fsdp sync", "fabriclite fsdp async")):
        if sync in facts and run in facts:  # the same figures with their units, for prose to quote
            peers.append(f"{name}: an asynchronous save call blocks {facts[run]['call'] * 1e3:.0f} ms against "
                         f"{facts[sync]['call'] * 1e3:.0f} ms synchronous, its snapshot "
                         f"{facts[run]['snapshot'] / 2**20:.0f} MiB, its stall {facts[run]['stall'] * 1e3:.0f} ms per "
                         f"save ({facts[run]['stall'] / facts[sync]['call']:.2f}x the synchronous save call)")
    if "DCP by hand async" in facts and "DCP by hand sync" in facts:
        peers.append(f"the floor, DCP's async_save by hand: stall "
                     f"{facts['DCP by hand async']['stall'] / facts['DCP by hand sync']['call']:.2f}x its synchronous "
                     f"save call")
    notes = ("\n\n" + "; ".join(peers) + "." if peers else "") + (
        "\n\nsave call: how long one save blocks the training loop (median over the saves, slower rank). stall per "
        "save: (steps with saves, the final wait included) minus (as many steps without, before and after), per save: "
        "background work "
        "competing with training for the CPU counts here. stall / sync save call: the asynchronous stall against the "
        "synchronous save call of the same strategy (goal <= 0.15). snapshot: bytes an asynchronous save copies on "
        "the rank that copies most; peak RSS rise: over the starting RSS during the run with saves (sampled every "
        "5 ms). final weights: the same for every configuration of a strategy means saving did not change training.")
    return table(headers, rows) + notes


if __name__ == "__main__":
    main()
