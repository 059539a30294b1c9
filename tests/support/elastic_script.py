"""A training run whose every loaded sample is recorded (tests/support/sample_accounting.py), for the elastic resume
tests: run it under `fabriclite run` at one world size, kill it, run it again at another.

Environment: CKPT_DIR (checkpoints, ``save(keep=3)`` every SAVE_EVERY steps, ``load_latest`` at the start),
ACCOUNT_DIR and ATTEMPT (the attempt's name; a restart round of the same job appends ``.r<round>``), LENGTH (samples,
default 50), BATCH (per rank, default 4), EPOCHS (the run ends after that many epochs, default 4), STRATEGY (ddp or
fsdp), KILL_AT=step:rank (that rank SIGKILLs itself right after that step, in round 0 of the attempt).

Rank 0 writes the attempt's facts (the step resumed from, the world size, the elastic-resume warning it got) and prints
``LOADED <sha256 of the model's full weights>`` after the load and ``SAVED <step> <sha256>`` at every save: a test
compares what an attempt loaded with what the attempt before saved at that step (fsdp: resharded through DCP).
"""
import hashlib
import os
import signal
import sys
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sample_accounting import Recorder  # noqa: E402

from fabriclite import Fabric  # noqa: E402

LENGTH = int(os.environ.get("LENGTH", "50"))
BATCH = int(os.environ.get("BATCH", "4"))
EPOCHS = int(os.environ.get("EPOCHS", "4"))
SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "3"))


class Points(Dataset):
    def __init__(self, recorder: Recorder) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(LENGTH, 6, generator=g), torch.randint(0, 3, (LENGTH,), generator=g)
        self.recorder = recorder

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i):
        self.recorder.loaded(int(i))
        return self.x[i], self.y[i]


def digest(fabric, model) -> str:
    """The SHA-256 of the model's full weights (every rank calls it: fsdp gathers)."""
    full = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]
    return hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in full)).hexdigest()


def main() -> None:
    fabric = Fabric(accelerator="cpu", strategy=os.environ.get("STRATEGY", "ddp"))
    fabric.launch()
    fabric.seed_everything(1234, verbose=False)
    attempt = os.environ["ATTEMPT"] + (f".r{fabric.restart_count}" if fabric.restart_count else "")
    now = {"step": 0}
    loader = None
    recorder = Recorder(os.environ["ACCOUNT_DIR"], attempt, fabric.global_rank,
                        lambda: (loader.epoch - 1, now["step"] + 1))
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(Points(recorder), batch_size=BATCH, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0, "resume": fabric.resume_state()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load_latest(os.environ["CKPT_DIR"], state)
    elastic = [str(w.message) for w in caught if "Elastic resume" in str(w.message)]
    for message in elastic:
        print(f"WARNING {message}", flush=True)
    step = now["step"] = state["step"]
    loaded = digest(fabric, model)
    if fabric.global_rank == 0:
        recorder.attempt_info(step, fabric.world_size, elastic)
        print(f"LOADED {step} {loaded}", flush=True)
    kill = tuple(int(v) for v in os.environ["KILL_AT"].split(":")) if os.environ.get("KILL_AT") else None
    while loader.epoch < EPOCHS:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            step = now["step"] = step + 1
            if kill and fabric.restart_count == 0 and step == kill[0] and fabric.global_rank == kill[1]:
                print(f"KILLED at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if step % SAVE_EVERY == 0:
                state["step"] = step
                fabric.save(os.path.join(os.environ["CKPT_DIR"], f"step-{step:04d}.ckpt"), state, keep=3)
                saved = digest(fabric, model)
                fabric.print(f"SAVED {step} {saved}", flush=True)
    fabric.print(f"DONE at step {step}", flush=True)


if __name__ == "__main__":
    main()
