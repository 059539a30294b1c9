"""A training loop that survives failures and preemption (docs/reliability.md, "Fault tolerance").

    fabriclite run --accelerator cpu --devices 2 --max-restarts 3 examples/fault_tolerant.py --ckpt /tmp/ft

It resumes from the newest checkpoint in --ckpt (if any), saves every --save-every steps keeping 3, and on a
preemption notice (SIGTERM / SIGUSR1 to `fabriclite run`) saves and exits: the job then exits 75, or is
requeued under SLURM. --crash-at STEP makes rank 1 fail once, in the first round, to watch a restart.
"""
import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabriclite import Fabric


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default="checkpoints")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--crash-at", type=int, default=None)
    args = parser.parse_args()

    fabric = Fabric()
    fabric.launch()
    fabric.seed_everything(42)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randint(0, 4, (512,), generator=g))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=16, shuffle=True))

    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0, "resume": fabric.resume_state()}
    resumed = fabric.load_latest(args.ckpt, state)  # None on the first start
    step = state["step"]
    fabric.print(f"round {fabric.restart_count}: starting at step {step} (from {resumed})")

    def save() -> None:
        state["step"] = step
        fabric.save(os.path.join(args.ckpt, f"step-{step:06d}.ckpt"), state, keep=3)

    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            step += 1
            if args.crash_at == step and fabric.restart_count == 0 and fabric.global_rank == 1:
                raise RuntimeError(f"rank 1 crashes at step {step} (--crash-at)")
            if step % 5 == 0 and fabric.check_preempted():  # one small all_reduce: every few steps
                save()
                fabric.print(f"preempted: saved step {step}, exiting")
                return
            if step % args.save_every == 0:
                save()
            if step >= args.steps:
                break
    fabric.print(f"done at step {step}, loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
