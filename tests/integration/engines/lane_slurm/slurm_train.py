"""The training job the SLURM lane runs (under ``srun python slurm_train.py`` or ``srun fabriclite run ...
slurm_train.py``): a small deterministic ddp loop, as examples/fault_tolerant.py, with what the tests need to see.

- resumes with ``load_latest(CKPT_DIR)`` (``resume_state()`` in the state), saves every SAVE_EVERY steps, and on a
  preemption notice (``fabric.check_preempted()``, every step) saves and exits 0;
- rank 0 writes the final weights to OUT, and one line per attempt to $ACCOUNT_DIR/attempts.log:
  ``<job> <SLURM_RESTART_COUNT> <fabriclite round> restart_count=<n> resumed=<step> world=<w> nodes=<n>``;
- sample accounting, logged from the dataset's ``__getitem__``: every process appends the index of each sample it
  loads to $ACCOUNT_DIR/samples-<job>-<slurm restarts>-<round>-<rank>.log, and after each optimizer step a line
  ``step <n> epoch <e>`` (the samples above it are that step's);
- STEP_SLEEP seconds per step, in the job's first attempt only (a resumed attempt finishes quickly: a job with
  ``--time`` is not signalled again), and rank 0 writes the last finished step to $ACCOUNT_DIR/progress;
- WAIT_AT=step (or step:array task): in the job's first attempt, rank 0 waits after that step until it has recorded
  a preemption signal (the others wait in the next collective), so the test's signal lands at that step;
- CRASH_AT=step:restart_count: rank 1 (or 0 in a one-rank job) exits 1 after that step in the attempt whose
  ``fabric.restart_count`` is that;
- an array task keeps its checkpoints, accounting and weights apart: CKPT_DIR/task<N>, ACCOUNT_DIR/task<N>,
  task<N>-<OUT's name> beside OUT;
- rank 0 appends ``<event> <unix time> <attempt>`` to $ACCOUNT_DIR/events.log: ``launched``, ``first_step`` (the
  attempt's first step done) and ``saved`` (the preemption save done), for benchmarks/engine_parts/slurm.py;
- SLURM_ENV="requeue_signal=USR2,auto_requeue=0" passes ``plugins=[SLURMEnvironment(...)]`` (ranks started by srun).
"""
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabriclite import Fabric

STEPS = int(os.environ.get("STEPS", "30"))
SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "5"))
SAMPLES = int(os.environ.get("SAMPLES", "60"))
CKPT_DIR, ACCOUNT_DIR, OUT = os.environ["CKPT_DIR"], os.environ["ACCOUNT_DIR"], os.environ["OUT"]
if os.environ.get("SLURM_ARRAY_TASK_ID"):  # each array task trains on its own: its own folders
    task = f"task{os.environ['SLURM_ARRAY_TASK_ID']}"
    CKPT_DIR, ACCOUNT_DIR, OUT = (os.path.join(CKPT_DIR, task), os.path.join(ACCOUNT_DIR, task),
                                  os.path.join(os.path.dirname(OUT), f"{task}-{os.path.basename(OUT)}"))
    os.makedirs(ACCOUNT_DIR, exist_ok=True)
ATTEMPT = "-".join([os.environ.get("SLURM_ARRAY_JOB_ID") and
                    f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}" or
                    os.environ.get("SLURM_JOB_ID", "nojob"), os.environ.get("SLURM_RESTART_COUNT", "0"),
                    os.environ.get("FABRICLITE_RESTART_COUNT", "0")])


class Logged(Dataset):
    """Fixed random points; ``__getitem__`` appends the index to this process's accounting file."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g)
        self.log = None

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i):
        self.log.write(f"{int(i)}\n")
        return self.x[i], self.y[i]


def event(fabric: Fabric, name: str) -> None:
    if fabric.global_rank == 0:
        with open(os.path.join(ACCOUNT_DIR, "events.log"), "a") as f:
            f.write(f"{name} {time.time():.3f} {ATTEMPT}\n")


def make_fabric() -> Fabric:
    spec = os.environ.get("SLURM_ENV")
    if not spec:
        return Fabric(accelerator="cpu", strategy="ddp")
    from fabriclite.plugins.environments import SLURMEnvironment

    kwargs = dict(item.split("=", 1) for item in spec.split(","))
    if "auto_requeue" in kwargs:
        kwargs["auto_requeue"] = kwargs["auto_requeue"] == "1"
    return Fabric(accelerator="cpu", strategy="ddp", plugins=[SLURMEnvironment(**kwargs)])


def main() -> None:
    fabric = make_fabric()
    fabric.launch()
    event(fabric, "launched")
    fabric.seed_everything(1234, verbose=False)
    data = Logged()
    data.log = open(os.path.join(ACCOUNT_DIR, f"samples-{ATTEMPT}-{fabric.global_rank}.log"), "a", buffering=1)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0, "resume": fabric.resume_state()}
    resumed = fabric.load_latest(CKPT_DIR, state)
    step = state["step"]
    first_step = step + 1
    data.log.write(f"attempt resumed={step if resumed else 0} world={fabric.world_size}\n")
    nodes = os.environ.get("SLURM_JOB_NUM_NODES", "?")
    line = (f"{ATTEMPT.replace('-', ' ')} restart_count={fabric.restart_count} resumed={step if resumed else 0} "
            f"world={fabric.world_size} nodes={nodes} node_rank={fabric.node_rank}")
    if fabric.global_rank == 0:
        with open(os.path.join(ACCOUNT_DIR, "attempts.log"), "a") as f:
            f.write(line + "\n")
    print(f"RANK {fabric.global_rank} of {fabric.world_size} node {fabric.node_rank} local {fabric.local_rank} "
          f"restart_count {fabric.restart_count}", flush=True)
    sleep = float(os.environ.get("STEP_SLEEP", "0")) if fabric.restart_count == 0 else 0.0
    wait = os.environ.get("WAIT_AT", "")
    wait_step = int(wait.split(":")[0]) if wait and (":" not in wait or wait.split(":")[1] ==
                                                      os.environ.get("SLURM_ARRAY_TASK_ID")) else -1
    crash = os.environ.get("CRASH_AT")
    crash_step, crash_count = (int(v) for v in crash.split(":")) if crash else (-1, -1)
    while step < STEPS:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            step += 1
            if step == first_step:
                event(fabric, "first_step")
            data.log.write(f"step {step} epoch {loader.epoch - 1}\n")  # the running epoch (iter() counted it)
            if fabric.global_rank == 0:
                with open(os.path.join(ACCOUNT_DIR, "progress"), "w") as f:
                    f.write(f"{ATTEMPT} {step}\n")
            if step == wait_step and fabric.restart_count == 0 and fabric.global_rank == 0:
                wait_for_signal()
            if step == crash_step and fabric.restart_count == crash_count and \
                    fabric.global_rank == min(1, fabric.world_size - 1):
                print(f"CRASH at step {step}", flush=True)
                sys.stdout.flush()
                os._exit(1)
            if fabric.check_preempted():
                state["step"] = step
                fabric.save(os.path.join(CKPT_DIR, f"step-{step:04d}.ckpt"), state, keep=3)
                event(fabric, "saved")
                fabric.print(f"PREEMPTED saved at step {step}", flush=True)
                return
            if step % SAVE_EVERY == 0:
                state["step"] = step
                fabric.save(os.path.join(CKPT_DIR, f"step-{step:04d}.ckpt"), state, keep=3)
            if step >= STEPS:
                break
            time.sleep(sleep)
    if fabric.global_rank == 0:
        torch.save([p.detach().clone() for p in model.parameters()], OUT)
    fabric.print(f"DONE restart_count {fabric.restart_count}", flush=True)


def wait_for_signal() -> None:
    from fabriclite.supervision.rank import signals as rank_signals

    with open(os.path.join(ACCOUNT_DIR, "waiting"), "w") as f:
        f.write("waiting\n")
    deadline = time.monotonic() + 240
    while rank_signals.received() is None and time.monotonic() < deadline:
        time.sleep(0.02)


if __name__ == "__main__":
    main()
