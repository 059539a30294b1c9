"""A training run for the bit-exact resume tests at 3 or more ranks (run it under `fabriclite run --devices N`).

The model registers its parameters in an order unlike their use in forward (so the order DDP's gradients become
ready, which its rebuilt buckets follow, is not the parameter order the first step's one bucket uses); float32,
a shuffled loader, SGD with momentum. ``state["resume"] = fabric.resume_state()``; a checkpoint after each step
in SAVE_AT (default "1,4": after step 1 the buckets' rebuild is still pending); ``load_latest`` at the start.
Rank 0 writes the final weights to $OUT.

- KILL_AT=step:rank   that rank SIGKILLs itself right after that step, in round 0
- STRATEGY            the strategy (default ddp)
- CONTROL=1   in a restarted round, after the run, the negative control: the layout fix switched off
  (FABRICLITE_DDP_BUCKET_LAYOUT=0), the same resume again from the same checkpoint in the same processes (a new
  model, DDP, optimizer and loader; no kills, no saves); its final weights go to $OUT.control
- REFERENCE_OUT, REFERENCE_CKPT_DIR   in round 0, before the run, the uninterrupted run in the same fresh processes
  (a new model, DDP, optimizer and loader; its saves into REFERENCE_CKPT_DIR, no kill): its final weights go to
  $REFERENCE_OUT. One job then holds both runs of a case, and its ranks start once for both.
"""
import gc
import os
import signal

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabriclite import Fabric
from fabriclite.strategies.ddp_buckets import SWITCH_ENV

STEPS = int(os.environ.get("STEPS", "8"))
SAVE_AT = {int(v) for v in os.environ.get("SAVE_AT", "1,4").split(",")}
CKPT_DIR = os.environ["CKPT_DIR"]


class Points(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Reordered(nn.Module):
    """Registered head, embed, mid; used embed -> mid -> head: gradients become ready head, mid, embed."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(24, 3)
        self.embed = nn.Linear(6, 48)
        self.mid = nn.Linear(48, 24)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.embed(x)))))


def train(fabric: Fabric, control: bool = False, reference: bool = False) -> list:
    """Set up, ``load_latest``, train to STEPS; the final weights (gathered under fsdp). ``control``: no kills and
    no saves (the negative control's pass). ``reference``: no kills, saves in REFERENCE_CKPT_DIR (the uninterrupted
    run's pass)."""
    ckpt_dir = os.environ["REFERENCE_CKPT_DIR"] if reference else CKPT_DIR
    fabric.seed_everything(1234, verbose=False)
    model = Reordered()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(Points(), batch_size=2, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0, "resume": fabric.resume_state()}
    resumed = fabric.load_latest(ckpt_dir, state)
    step = state["step"]
    name = "CONTROL" if control else "REFERENCE" if reference else "ROUND"
    fabric.print(f"{name} {fabric.restart_count} resumed from {os.path.basename(resumed) if resumed else None} "
                 f"at step {step}", flush=True)
    kill = os.environ.get("KILL_AT")
    kill_step, kill_rank = (int(v) for v in kill.split(":")) if kill and not control and not reference else (-1, -1)
    while step < STEPS:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            step += 1
            if fabric.restart_count == 0 and step == kill_step and fabric.global_rank == kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if step in SAVE_AT and not control:
                state["step"] = step
                fabric.save(os.path.join(ckpt_dir, f"step-{step:04d}.ckpt"), state, keep=2)
            if step >= STEPS:
                break
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


def main() -> None:
    fabric = Fabric(accelerator="cpu", strategy=os.environ.get("STRATEGY", "ddp"))
    fabric.launch()
    if os.environ.get("REFERENCE_OUT") and fabric.restart_count == 0:
        reference = train(fabric, reference=True)
        if fabric.global_rank == 0:
            torch.save(reference, os.environ["REFERENCE_OUT"])
        gc.collect()  # the reference's DDP module is gone: its bucket layout is not recorded with the run's
        layouts = fabric.strategy.bucket_layout() if hasattr(fabric.strategy, "bucket_layout") else None
        assert layouts is None, f"the reference pass's DDP module outlived it: {layouts}"
    final = train(fabric)
    if fabric.global_rank == 0:
        torch.save(final, os.environ["OUT"])
    if os.environ.get("CONTROL") == "1" and fabric.restart_count > 0:
        os.environ[SWITCH_ENV] = "0"  # the same resume, from the same checkpoint, without the recorded layout
        control = train(fabric, control=True)
        if fabric.global_rank == 0:
            torch.save(control, os.environ["OUT"] + ".control")
    fabric.print(f"DONE round {fabric.restart_count}", flush=True)


if __name__ == "__main__":
    main()
