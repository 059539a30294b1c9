"""The script the ft lane's DiLoCo / LocalSGD tests run under ``fabriclite run --fault-tolerant --strategy diloco``
(or ``local_sgd``, with the family's flags): a plain Fabric loop (no torchft import; the inner optimizer AdamW)
that writes, under ``OUT`` (argv[1]), for its replica group ``g``:

    steps-<g>.txt   start <restart round> <step after load_latest> <time> <what load_latest returned>
                    <step after the iteration> <torchft's step: syncs committed> <loss>
    sync-<g>-<s>.pt the sync's state (``fabric.strategy.sync_state()``) and the model's buffers right after the
                    inner step at which torchft's step became s (a committed sync)
    joined-<g>.pt   the same, right after load_latest, when the group came back (restart round >= 1)
    final-<g>.pt    the model's state_dict at the end; ``reloaded-<g>.pt``: the sync's state after ``fabric.load``
                    of the group's last checkpoint (``FT_SAVE_EVERY``: each N steps to OUT/checkpoints-<g>)

It trains ``STEPS`` (argv[2]) inner steps, then stops at the next step that ends a round of syncs once every group
of ``FT_KILL_GROUP`` has come back and committed a sync since (``resynced-<g>``, written by that group: a group
that came back late, after the others' ``STEPS``, still takes a sync with them before anyone stops). ``FT_KILL_GROUP`` / ``FT_KILL_STEP``: that group's rank SIGKILLs itself at the
second all-reduce of the first sync after that step, in its first incarnation (the others are inside that sync's
all-reduces). ``FT_BN=1`` puts a BatchNorm in the model. ``FT_DELAY_GROUP`` / ``FT_DELAY_S``: that group's rank
sleeps that long before ``fabric.setup`` (its Manager, then its first quorum, start late). ``FT_SKEW_GROUP``: that
group changes one of its global weights after the loop (the end-of-run comparison must fail).
"""
import os
import signal
import sys
import time

import torch
from torch import nn

from fabriclite import Fabric

out, steps = sys.argv[1], int(sys.argv[2])
kill_groups = [int(g) for g in os.environ.get("FT_KILL_GROUP", "").split(",") if g]
kill_step = int(os.environ.get("FT_KILL_STEP", "-1"))
save_every = int(os.environ.get("FT_SAVE_EVERY", "0"))

fabric = Fabric()
group = int(os.environ["FABRICLITE_FT_GROUP"])
torch.manual_seed(1234 + group)  # different initial weights per group: the job's first quorum makes them equal
layers = [nn.Linear(16, 32), nn.BatchNorm1d(32)] if os.environ.get("FT_BN") == "1" else [nn.Linear(16, 32)]
model = nn.Sequential(*layers, nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=float(os.environ.get("FT_LR", "0.01")))
if group == int(os.environ.get("FT_DELAY_GROUP", "-1")) and fabric.restart_count == 0:
    time.sleep(float(os.environ.get("FT_DELAY_S", "0")))  # this group starts its Manager (and first quorum) late
model, optimizer = fabric.setup(model, optimizer)
state = {"model": model, "optimizer": optimizer, "step": 0}
checkpoints = os.path.join(out, f"checkpoints-{group}")
log = open(os.path.join(out, f"steps-{group}.txt"), "a", buffering=1)
source = fabric.load_latest(checkpoints, state)
log.write(f"start {fabric.restart_count} {state['step']} {time.time():.4f} {source}\n")
strategy = fabric.strategy
settings = strategy.settings


def snapshot() -> dict:
    return {"sync": strategy.sync_state(), "buffers": {k: v.clone() for k, v in model.module.named_buffers()}}


if fabric.restart_count > 0:
    torch.save(snapshot(), os.path.join(out, f"joined-{group}.pt"))

if group in kill_groups and fabric.restart_count == 0:
    manager, allreduce, calls = strategy.manager, strategy.manager.allreduce, []

    def dying_allreduce(tensor, *args, **kwargs):
        if state["step"] >= kill_step:
            calls.append(1)
            if len(calls) == 2:  # the sync's first all-reduce is out: the others are waiting for the rest
                os.kill(os.getpid(), signal.SIGKILL)
        return allreduce(tensor, *args, **kwargs)

    manager.allreduce = dying_allreduce


def resynced(g: int) -> str:
    return os.path.join(out, f"resynced-{g}")


def all_back() -> bool:
    return all(os.path.exists(resynced(g)) for g in kill_groups)


synced = strategy.sync_state()["manager"]["step"]
while not (state["step"] >= steps and state["step"] % settings.sync_every == 0 and all_back()):
    optimizer.zero_grad()
    gen = torch.Generator().manual_seed(100_000 * group + state["step"])
    x = torch.randn(32, 16, generator=gen)
    loss = ((model(x) - x.sum(1, keepdim=True).tanh()) ** 2).mean()
    fabric.backward(loss)
    optimizer.step()
    state["step"] += 1
    now = strategy.sync_state()["manager"]["step"]
    if now != synced:
        synced = now
        torch.save(snapshot(), os.path.join(out, f"sync-{group}-{now}.pt"))
        if fabric.restart_count > 0 and group in kill_groups and not os.path.exists(resynced(group)):
            open(resynced(group), "w").close()
    if save_every and state["step"] % save_every == 0:
        fabric.save(os.path.join(checkpoints, f"step-{state['step']:04d}.ckpt"), state, keep=2)
    log.write(f"{state['step']} {now} {loss.item():.6f}\n")

torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, f"final-{group}.pt"))
if group == int(os.environ.get("FT_SKEW_GROUP", "-1")):  # this group's global weights part from the others'
    with torch.no_grad():
        next(iter(strategy._sync._fragments[0].original_parameters.values())).view(-1)[0] += 1e-3
if save_every:
    last = sorted(p for p in os.listdir(checkpoints) if p.endswith(".ckpt"))[-1]
    fabric.load(os.path.join(checkpoints, last), state)
    torch.save(snapshot(), os.path.join(out, f"reloaded-{group}.pt"))
log.write(f"end {state['step']} {time.time():.4f}\n")
