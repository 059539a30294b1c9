"""The job of the fault storm (tests/integration/checkpoint/test_fault_storm.py), run under `fabriclite run` on 2
ranks and launched again until it finishes: a deterministic training run (shuffled loader, dropout, AdamW,
``resume_state``) that saves with ``save(..., keep=KEEP)`` every SAVE_EVERY steps, resumes with ``load_latest``,
and records every sample it loads (tests/support/sample_accounting.py, attempt ``a<LAUNCH>.r<round>``). Rank 0
writes the final weights to $OUT.

FAULTS (JSON list) are injected at a given step and round, never by timing; each is ``[kind, step, rank, round]``:

- ``kill``: that rank SIGKILLs itself after the step;
- ``kill_in_save``: rank 0 SIGKILLs itself inside torch.save of the checkpoint holding that step, half of it
  written (a temporary left behind);
- ``kill_in_record``: rank 0 SIGKILLs itself once the checkpoint of that step is published, before the manifest
  records it (a checkpoint left at its final name, pending);
- ``hang``: that rank sleeps after the step (the supervisor's step watch, $FABRICLITE_HANG_TIMEOUT, stops it);
- ``preempt``: rank 0 prints ``PREEMPT_ME`` after the step and waits for the test's SIGUSR1 to the supervisor;
  every step checks ``check_preempted`` and saves then;
- ``kill_supervisor``: rank 0 prints ``KILL_SUPERVISOR`` after the step and waits for the test to SIGKILL the
  supervisor (the ranks die with it).

ASYNC=1 saves in the background (AsyncCheckpointIO). Every rank prints ``PID <rank> <pid>``; rank 0 prints
``AT <step>`` at each save and ``DONE`` at the end.
"""
import json
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabriclite import Fabric

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sample_accounting import Recorder  # noqa: E402

STEPS = int(os.environ.get("STEPS", "30"))
SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "3"))
KEEP = int(os.environ.get("KEEP", "2"))
LENGTH, BATCH = 48, 4
CKPT_DIR = os.environ["CKPT_DIR"]


class Points(Dataset):
    def __init__(self, recorder=None) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(LENGTH, 6, generator=g), torch.randint(0, 3, (LENGTH,), generator=g)
        self.recorder = recorder

    def __len__(self) -> int:
        return LENGTH

    def __getitem__(self, i):
        if self.recorder is not None:
            self.recorder.loaded(int(i))
        return self.x[i], self.y[i]


def say(text: str) -> None:
    os.write(1, (text + "\n").encode())  # one write: the ranks share the pipe


def main() -> None:
    plugins = None
    if os.environ.get("ASYNC") == "1":
        from fabriclite.plugins.io import AsyncCheckpointIO

        plugins = [AsyncCheckpointIO()]
    fabric = Fabric(accelerator="cpu", plugins=plugins)
    fabric.launch()
    rank, round_ = fabric.global_rank, fabric.restart_count
    say(f"PID {rank} {os.getpid()}")
    faults = [tuple(f) for f in json.loads(os.environ.get("FAULTS", "[]"))]
    mine = {(kind, step) for kind, step, r, rnd in faults if rnd == round_ and r == rank}
    fabric.seed_everything(1234, verbose=False)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    at = {"step": 0}
    per_epoch = LENGTH // (BATCH * fabric.world_size)
    recorder = None
    if os.environ.get("SAMPLES"):
        recorder = Recorder(os.environ["SAMPLES"], f"a{int(os.environ['LAUNCH']):03d}.r{round_}", rank,
                            lambda: (at["step"] // per_epoch, at["step"] + 1))
    loader = fabric.setup_dataloaders(DataLoader(Points(recorder), batch_size=BATCH, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0, "resume": fabric.resume_state()}
    resumed = fabric.load_latest(CKPT_DIR, state)
    step = at["step"] = state["step"]
    if recorder is not None and rank == 0:
        recorder.attempt_info(step, fabric.world_size, [])
    fabric.barrier()  # the attempt is on record before any sample is loaded
    say(f"ROUND {round_} resumed from {os.path.basename(resumed) if resumed else None} at step {step}")
    _arm_save_faults(rank, mine)
    while step < STEPS:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            step = at["step"] = step + 1
            _fault_after(step, mine)
            if fabric.check_preempted():
                state["step"] = step
                fabric.save(os.path.join(CKPT_DIR, f"step-{step:04d}.ckpt"), state, keep=KEEP)
                if rank == 0:
                    say(f"PREEMPTED saved at step {step}")
                return
            if step % SAVE_EVERY == 0 or step == STEPS:
                state["step"] = step
                fabric.save(os.path.join(CKPT_DIR, f"step-{step:04d}.ckpt"), state, keep=KEEP)
                if rank == 0:
                    say(f"AT {step}")
            if step >= STEPS:
                break
    if rank == 0:
        torch.save([p.detach() for p in model.parameters()], os.environ["OUT"])
        say("DONE")


def _fault_after(step, mine) -> None:
    if ("kill", step) in mine:
        os.kill(os.getpid(), signal.SIGKILL)
    if ("hang", step) in mine:
        time.sleep(600)
    if ("preempt", step) in mine:
        from fabriclite.supervision.rank import signals as rank_signals

        say("PREEMPT_ME")
        deadline = time.monotonic() + 120
        while rank_signals.received() is None and time.monotonic() < deadline:
            time.sleep(0.01)
    if ("kill_supervisor", step) in mine:
        say("KILL_SUPERVISOR")
        time.sleep(120)  # the test kills the supervisor; this rank dies with it


def _arm_save_faults(rank, mine) -> None:
    """Rank 0 dies inside torch.save of a chosen step's checkpoint, or between its publication and its record."""
    in_save = {step for kind, step in mine if kind == "kill_in_save"}
    in_record = {step for kind, step in mine if kind == "kill_in_record"}
    if rank != 0 or not (in_save or in_record):
        return
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") in in_save and hasattr(f, "write"):
            f.write(b"half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save
    from fabriclite.checkpoint import manifest

    real_record = manifest.record

    def record(directory, name, *args, **kwargs):
        if any(name == f"step-{step:04d}.ckpt" for step in in_record):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_record(directory, name, *args, **kwargs)

    manifest.record = record


if __name__ == "__main__":
    main()
