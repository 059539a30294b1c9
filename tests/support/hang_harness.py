"""The script of the hang tests (tests/integration/supervision/test_hangs.py): a small DDP training loop whose ranks
hang on demand (``HANG``), printing ``FAULT {json}`` records for the fault harness (faults_harness.Job) and its final
weights (``WEIGHTS <hex>``, rank 0)."""
from __future__ import annotations

import textwrap
from pathlib import Path

HANG_SCRIPT = r'''
import json, os, sys, threading, time
import torch
from fabriclite import Fabric

HANG = os.environ.get("HANG", "none")
STEPS = int(os.environ.get("STEPS", "6"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))


def say(**record):
    os.write(1, ("FAULT " + json.dumps(record) + "\n").encode())


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 4 * 2 * 64

    def __getitem__(self, index):
        if HANG == "getitem" and int(os.environ["RANK"]) == 1 and index >= 16:
            say(fault_at=time.time())
            time.sleep(10_000)  # HANG-GETITEM: stuck in user code before the gradient all-reduce
        g = torch.Generator().manual_seed(index)
        return torch.randn(4, generator=g), torch.randn(1, generator=g)


def deadlock():
    lock = threading.Lock()
    lock.acquire()
    worker = threading.Thread(target=lambda: lock.acquire(), name="deadlocked-worker")  # HANG-THREAD
    worker.start()
    say(fault_at=time.time())
    worker.join()


def main():
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    rank = fabric.global_rank
    say(rank=rank, pid=os.getpid(), pgid=os.getpgid(0))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(Data(), batch_size=4))
    step = 0
    for x, y in loader:
        if HANG == "deadlock" and rank == 1 and step == 2:
            deadlock()
        if HANG == "extra" and step == 2:
            if rank == 0:
                say(fault_at=time.time())
                fabric.barrier()  # HANG-EXTRA: a collective the other rank never calls
            else:
                time.sleep(2)  # rank 0's barrier times out first; this rank then waits in backward
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)  # HANG-BACKWARD
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 3:
            say(rank=rank, ready=True)
        time.sleep(STEP_SLEEP)
        if step == STEPS:
            break
    if rank == 0:
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        print("WEIGHTS " + weights.numpy().tobytes().hex(), flush=True)
    say(rank=rank, done=True)


if __name__ == "__main__":
    main()
'''


def hang_script(tmp: Path) -> Path:
    script = tmp / "hang_script.py"
    if not script.exists():
        script.write_text(textwrap.dedent(HANG_SCRIPT))
    return script


def line_of(marker: str) -> int:
    """The line number (1-based) of the script line holding ``marker``."""
    lines = textwrap.dedent(HANG_SCRIPT).splitlines()
    return next(i + 1 for i, line in enumerate(lines) if marker in line)
