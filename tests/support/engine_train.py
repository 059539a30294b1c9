"""The training run of the engine lanes (tests/integration/engines): an example-like fabriclite loop that any engine
can start unchanged (torchrun's agent, Ray Train's workers, ``fabriclite run``).

``Fabric()`` with its defaults (the engine is detected), a shuffled map-style dataset through
``fabric.setup_dataloaders`` (a DistributedSampler), dropout, AdamW, ``state["resume"] = fabric.resume_state()``,
a checkpoint every SAVE_EVERY steps with ``fabric.save(..., keep=3)``, ``fabric.load_latest`` at the start and a
short sleep per step, so that a fault from outside lands mid-run. Settings come from the environment or from
``main(settings)`` (Ray Train's ``train_loop_config``):

- CKPT_DIR   checkpoints (a path every rank sees)          LOG_DIR   the accounting logs (one file per process)
- OUT        rank 0 writes the final parameters there      STEPS, SAVE_EVERY, SLEEP (seconds per step)
- N, BATCH   the dataset's length and the per-rank batch size
- KILL_AT=step:rank   that rank SIGKILLs itself right after that step, once per job (a marker file in LOG_DIR
  says it happened, so the restarted attempt does not do it again)

Accounting (tests/support/engine_checks.py reads it): every sample the dataset hands out is recorded in its
``__getitem__``; after each optimizer step the process appends ``{"step", "epoch", "indices"}`` to its log, after a
``{"start": ...}`` record naming the attempt (an id rank 0 broadcasts), the rank, the world size, the step it resumed
from and ``fabric.restart_count``.
"""
import json
import os
import signal
import time
import warnings
from typing import Any, Dict, List, Mapping, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabriclite import Fabric

DEFAULTS = {"STEPS": "30", "SAVE_EVERY": "5", "SLEEP": "0.05", "N": "50", "BATCH": "4"}


class Logged(Dataset):
    """N points; ``__getitem__`` records each index it hands out (the loop drains them once per step)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
        self.served: List[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.served.append(int(i))
        return self.x[i], self.y[i]


def main(settings: Optional[Mapping[str, Any]] = None) -> None:
    """Train; ``settings`` (name -> value) are set in the environment first (Ray Train passes them as its config)."""
    for name, value in (settings or {}).items():
        os.environ[name] = str(value)
    env = {**DEFAULTS, **os.environ}
    steps, save_every, sleep = int(env["STEPS"]), int(env["SAVE_EVERY"]), float(env["SLEEP"])
    ckpt_dir, log_dir = env["CKPT_DIR"], env["LOG_DIR"]
    kill_at = tuple(int(v) for v in env["KILL_AT"].split(":")) if env.get("KILL_AT") else None

    group_before_launch = torch.distributed.is_initialized()  # Ray Train makes the process group itself
    fabric = Fabric()
    fabric.launch()
    fabric.seed_everything(1234, verbose=False)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    dataset = Logged(int(env["N"]))
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=int(env["BATCH"]), shuffle=True))
    state: Dict[str, Any] = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0,
                             "resume": fabric.resume_state()}
    with warnings.catch_warnings(record=True) as caught:  # the elastic resume's warning names the padding
        warnings.simplefilter("always")
        resumed = fabric.load_latest(ckpt_dir, state)
    for warning in caught:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    step = state["step"]
    attempt = fabric.broadcast(f"{time.time_ns()}-{os.getpid()}" if fabric.global_rank == 0 else None, src=0)
    os.makedirs(log_dir, exist_ok=True)
    log = open(os.path.join(log_dir, f"log-{attempt}-rank{fabric.global_rank}.jsonl"), "a", buffering=1)
    log.write(json.dumps({"start": attempt, "rank": fabric.global_rank, "world": fabric.world_size,
                          "resumed_step": step, "resumed_from": os.path.basename(resumed) if resumed else None,
                          "restart_count": fabric.restart_count, "pid": os.getpid(), "t": time.time(),
                          "group_before_launch": group_before_launch, "process_start": _process_start(),
                          "warnings": [str(w.message) for w in caught]}) + "\n")
    dataset.served.clear()
    fabric.print(f"ATTEMPT {attempt} world {fabric.world_size} restart_count {fabric.restart_count} resumed at step "
                 f"{step}", flush=True)

    while step < steps:
        epoch = int(loader.state_dict()["epoch"])  # before iter(): the epoch this pass runs
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            step += 1
            log.write(json.dumps({"step": step, "epoch": epoch, "indices": dataset.served, "t": time.time()}) + "\n")
            dataset.served = []
            if kill_at and (step, fabric.global_rank) == kill_at and _first_kill(log_dir):
                log.write(json.dumps({"killed": step, "t": time.time()}) + "\n")
                os.kill(os.getpid(), signal.SIGKILL)
            if step % save_every == 0:
                state["step"] = step
                fabric.save(os.path.join(ckpt_dir, f"step-{step:04d}.ckpt"), state, keep=3)
            time.sleep(sleep)
            if step >= steps:
                break
    if fabric.global_rank == 0 and env.get("OUT"):
        torch.save([p.detach().clone() for p in model.parameters()], env["OUT"])
    log.write(json.dumps({"done": step, "t": time.time()}) + "\n")
    fabric.print(f"DONE at step {step} world {fabric.world_size}", flush=True)


def _process_start() -> float:
    """This process's start, Unix time (Linux /proc; 10 ms resolution): the recovery benchmark's parts."""
    # /proc/stat's btime is whole seconds (up to 1 s off); /proc/uptime is read now, at 10 ms, on the same clock as
    # the start ticks, so the start is placed on time.time()'s scale from the time since it.
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    now = time.time()
    return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def _first_kill(log_dir: str) -> bool:
    """True once per job: creates the marker file, which no later attempt can create again."""
    try:
        os.close(os.open(os.path.join(log_dir, "killed.marker"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default=None, help="the checkpoint folder (else $CKPT_DIR)")
    args = parser.parse_args()
    main({"CKPT_DIR": args.ckpt} if args.ckpt else None)
