"""A deterministic training run for the restart and preemption tests (run it under `fabriclite run`).

Shuffled loader, dropout, AdamW and an LR schedule; ``state["resume"] = fabric.resume_state()``; a checkpoint
every SAVE_EVERY steps with ``save(keep=3)``, mid-epoch; ``load_latest`` at the start. Rank 0 writes the final
weights to $OUT. Faults are injected from here, at a given step, never by timing:

- KILL_AT=step:rank   that rank SIGKILLs itself right after that step, in round 0 (every round with KILL_ALWAYS=1)
- KILL_IN_SAVE=step   rank 0 SIGKILLs itself inside torch.save of the checkpoint holding that step, half of it
                      written (round 0)
- FAIL_EARLY=round:rank   that rank exits with code 3 before joining the job in that round (its rendezvous)
- WAIT_AT=step        rank 0 prints "WAITING" after that step and waits until it has recorded a preemption
                      signal (the test sends SIGUSR1 to the supervisor when it reads the line)
- KILL_IN_SHARD=step:rank   that rank SIGKILLs itself inside torch.distributed.checkpoint's write of its shard of
                      that step's checkpoint (round 0; STRATEGY=fsdp)
- WAIT_SPARES=step:rank   after that step (round 0), that rank waits until its supervisor's warm spares
                      (launchers/warm_spare.py) are all waiting with their imports done, then prints
                      "SPARES READY pids=<pid,pid> t=<unix time> rss_kb=<n> pss_kb=<n>" (the first spare's memory,
                      /proc/PID/smaps_rollup), before KILL_AT / WAIT_AT act at that step

PHASES=1 prints "PHASE <name> rank=<r> t=<unix time> pid=<pid>" on every rank at: the process's start (from /proc), its
imports done, launch() done, setup done, load_latest done and its first optimizer step done ("stepped")
(benchmarks/restart_timing.py's restart breakdown).

STRATEGY=fsdp shards the model (FSDPStrategy); ASYNC=1 saves in the background (AsyncCheckpointIO, or
FSDPStrategy(async_save=True)).
"""
import os
import signal
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabriclite import Fabric

STEPS = int(os.environ.get("STEPS", "20"))
SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "5"))
CKPT_DIR = os.environ["CKPT_DIR"]


class Points(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def pair(name):
    raw = os.environ.get(name)
    return tuple(int(v) for v in raw.split(":")) if raw else None


def make_fabric() -> Fabric:
    strategy, plugins = os.environ.get("STRATEGY", "auto"), None
    if os.environ.get("ASYNC") == "1":
        if strategy == "fsdp":
            from fabriclite.strategies import FSDPStrategy

            strategy = FSDPStrategy(async_save=True)
        else:
            from fabriclite.plugins.io import AsyncCheckpointIO

            plugins = [AsyncCheckpointIO()]
    return Fabric(accelerator="cpu", strategy=strategy, plugins=plugins)


def process_start() -> float:
    """This process's start, Unix time (Linux /proc; 10 ms resolution)."""
    # /proc/stat's btime is whole seconds (up to 1 s off); /proc/uptime is read now, at 10 ms, on the same clock as
    # the start ticks, so the start is placed on time.time()'s scale from the time since it.
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    now = time.time()
    return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def phase(name, at=None):
    if os.environ.get("PHASES") == "1":
        rank = os.environ.get("FABRICLITE_RANK", os.environ.get("RANK", "?"))
        print(f"PHASE {name} rank={rank} t={time.time() if at is None else at} pid={os.getpid()}", flush=True)


def main() -> None:
    phase("start", process_start())
    phase("imported")
    fabric = make_fabric()
    round_env = int(os.environ.get("FABRICLITE_RESTART_COUNT", "0"))
    fail_early = pair("FAIL_EARLY")
    if fail_early and fail_early[0] == round_env and int(os.environ.get("FABRICLITE_RANK", "-1")) == fail_early[1]:
        sys.exit(3)  # before launch(): the others wait for this rank in the round's rendezvous
    fabric.launch()
    phase("launched")
    fabric.seed_everything(1234, verbose=False)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(Points(), batch_size=4, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "step": 0,
             "resume": fabric.resume_state()}
    phase("set_up")
    resumed = fabric.load_latest(CKPT_DIR, state)
    phase("resumed")
    step = state["step"]
    fabric.print(f"ROUND {fabric.restart_count} resumed from {os.path.basename(resumed) if resumed else None} "
                 f"at step {step} t={time.time()}", flush=True)
    kill_at, kill_in_save, wait_at = pair("KILL_AT"), os.environ.get("KILL_IN_SAVE"), os.environ.get("WAIT_AT")
    first_round = fabric.restart_count == 0 or os.environ.get("KILL_ALWAYS") == "1"
    if kill_in_save and fabric.global_rank == 0 and first_round:
        _kill_inside_save(int(kill_in_save))
    kill_in_shard, wait_spares = pair("KILL_IN_SHARD"), pair("WAIT_SPARES")
    if kill_in_shard and fabric.global_rank == kill_in_shard[1] and first_round:
        _kill_inside_shard(kill_in_shard[0], lambda: state["step"])
    stepped = False
    while step < STEPS:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            if not stepped:
                stepped = True
                phase("stepped")  # this round's first optimizer step
            scheduler.step()
            step += 1
            if wait_spares and first_round and (step, fabric.global_rank) == wait_spares:
                pids = _wait_for_spares(int(os.environ.get("FABRICLITE_LOCAL_WORLD_SIZE", "2")))
                rss, pss = memory_kb(pids[0]) if pids else (0, 0)
                print(f"SPARES READY pids={','.join(map(str, pids))} t={time.time()} rss_kb={rss} pss_kb={pss}",
                      flush=True)
            if kill_at and first_round and step == kill_at[0] and fabric.global_rank == kill_at[1]:
                print(f"KILLED t={time.time()}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if wait_at and step == int(wait_at) and fabric.global_rank == 0 and fabric.restart_count == 0:
                _wait_for_preemption()
            if os.environ.get("CHECK_PREEMPTED") and fabric.check_preempted():
                state["step"] = step
                fabric.save(os.path.join(CKPT_DIR, f"step-{step:04d}.ckpt"), state, keep=3)
                fabric.print(f"PREEMPTED saved at step {step}", flush=True)
                return
            if step % SAVE_EVERY == 0:
                state["step"] = step
                fabric.save(os.path.join(CKPT_DIR, f"step-{step:04d}.ckpt"), state, keep=3)
            if step >= STEPS:
                break
    final = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]  # fsdp: gathered
    if fabric.global_rank == 0:
        torch.save(final, os.environ["OUT"])
    fabric.print(f"DONE round {fabric.restart_count}", flush=True)


def _kill_inside_save(at_step):
    """Kill this process inside torch.save of the checkpoint that holds ``step == at_step``, whenever that write
    runs: an asynchronous save of an earlier step may write while the training loop is already there."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == at_step and hasattr(f, "write"):
            f.write(b"half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def _kill_inside_shard(at_step, current_step):
    from torch.distributed.checkpoint import filesystem

    real_write = filesystem._write_item

    def write(*args, **kwargs):
        result = real_write(*args, **kwargs)  # one item of this rank's shard file is written, the rest is not
        if current_step() == at_step:
            print(f"KILLED IN SHARD t={time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    filesystem._write_item = write


def spare_pids(supervisor):
    """``supervisor``'s warm spares whose imports are done (named READY_NAME: launchers/warm_spare.py)."""
    try:
        with open(f"/proc/{supervisor}/task/{supervisor}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        return []
    ready = []
    for pid in children:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "warm-spare":  # launchers/warm_spare.py's READY_NAME
                    ready.append(pid)
        except OSError:
            pass
    return ready


def memory_kb(pid):
    """(RSS, PSS) of ``pid`` in kB (Linux /proc/PID/smaps_rollup)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[-1:] == ["kB"]}
    return fields["Rss"], fields["Pss"]


def _wait_for_spares(count):
    deadline = time.monotonic() + 120
    while len(spare_pids(os.getppid())) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return spare_pids(os.getppid())


def _wait_for_preemption():
    from fabriclite.supervision.rank import signals as preemption

    print("WAITING", flush=True)
    deadline = time.monotonic() + 120
    while preemption.received() is None and time.monotonic() < deadline:
        time.sleep(0.01)


if __name__ == "__main__":
    main()
