"""The script the ft lane runs under ``fabriclite run --fault-tolerant``: a plain Fabric training loop (no torchft
import) that keeps its step in the state dict it passes to ``load_latest``, saves no checkpoint unless
``FT_SAVE_EVERY`` is set (a healed state can then only come from a live peer; with it, each group saves to its own
``OUT/checkpoints-<group>`` every N committed steps, keep=2), and appends one line per loop iteration to ``OUT/steps-<group>.txt``:

    start <restart round> <step after load_latest> <time> <what load_latest returned>
    process <restart round> <the process's start time>
    saved <step> <time when fabric.save returned>
    <step after this iteration> <time> <1 if the step committed else 0>

A group stops once it has reached ``STEPS``, made a step since it started, every group has started (a ``start``
line in its log) and every group named in ``FT_WAIT_BACK`` (default: the killed ones) has come back (a ``start``
line of round >= 1): the healthy groups keep training while a late or killed one starts, however slow that is on
a loaded machine, and all end at the same step. At the
end it writes its weights to ``OUT/final-<group>.pt``. ``FT_KILL_GROUP`` / ``FT_KILL_STEP`` /
``FT_KILL_WHERE`` (``between``: after a committed step; ``allreduce``: after the forward, while the others wait
in the gradient all-reduce) SIGKILL that group's rank at the first step >= FT_KILL_STEP of its first incarnation
(``FT_KILL_ROUNDS``: of its first N). ``FT_WAIT_STARTS=group:n``: the groups also wait until that group has started
n times (relaunched by hand). ``FT_HANG_GROUP`` / ``FT_HANG_STEP``: that group's rank sleeps for good
(user code, no collective) after that step, in its first incarnation. ``FT_DELAY_GROUP`` / ``FT_DELAY_S``: that
group's rank sleeps that long before ``fabric.setup`` (its Manager, then its first quorum, start late). After its
first ``load_latest`` each group writes its weights to ``OUT/initial-<group>.pt``.

Replica groups of several ranks (``--devices R``): group rank r > 0 writes ``steps-<group>.<r>.txt``,
``final-<group>.<r>.pt`` (and so on) beside group rank 0's ``<group>`` files; each rank's data comes from its data rank
``group * R + r`` (plain ddp: the global rank), and a ``process`` line also gives ``$RANK`` and ``$WORLD_SIZE``.
``FT_KILL_RANK``: which group rank FT_KILL_GROUP's kill hits (default 0); ``FT_KILL_PLAN=round:rank:where:step,...``:
one kill per restart round instead; ``where`` may also be ``backward`` (in the first layer's gradient hook, the last
one backward computes). ``FT_DELAY_RESTARTED_RANK0_S``: a restarted group's rank 0 sleeps that long
before ``fabric.setup`` (its Manager comes after the other ranks'). ``FT_PARAM_STATE``: the state holds an
``nn.Parameter``. ``FT_SAVE_GRAD``: the first step's averaged gradient to ``OUT/grad-<name>.pt``; ``FT_SAVE_OPT``:
the optimizer state, the step, that Parameter and the DDP bucket sizes to ``OUT/optim-<name>.pt`` at the end.
"""
import time

STARTED = time.time()  # the process's start, before torch is imported (the benchmark's restart-to-step time)

import os  # noqa: E402
import signal
import sys  # noqa: E402

import torch
from torch import nn  # noqa: E402

from fabriclite import Fabric  # noqa: E402

out, steps = sys.argv[1], int(sys.argv[2])
pace = float(os.environ.get("FT_PACE", "0.02"))
kill_groups = [int(g) for g in os.environ.get("FT_KILL_GROUP", "").split(",") if g]
kill_step = int(os.environ.get("FT_KILL_STEP", "-1"))
kill_where = os.environ.get("FT_KILL_WHERE", "between")
kill_rounds = int(os.environ.get("FT_KILL_ROUNDS", "1"))
wait_back = [int(g) for g in os.environ.get("FT_WAIT_BACK", os.environ.get("FT_KILL_GROUP", "")).split(",") if g]
#: "group:n,...": also wait until that group has started n times (a group relaunched by hand after it ended)
wait_starts = [tuple(int(x) for x in p.split(":")) for p in os.environ.get("FT_WAIT_STARTS", "").split(",") if p]


def started(g: int, min_round: int, times: int = 1) -> bool:
    path = os.path.join(out, f"steps-{g}.txt")
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    return sum(line.startswith("start ") and int(line.split()[1]) >= min_round for line in lines) >= times


def all_back() -> bool:
    """Every group has started in this launch (a group starting after the others ended would train alone) and
    every group of FT_WAIT_BACK has come back."""
    groups = int(os.environ.get("FABRICLITE_FT_GROUPS", "1"))
    return all(started(g, 0) for g in range(groups)) and all(started(g, 1) for g in wait_back) and \
        all(started(g, 0, n) for g, n in wait_starts)


fabric = Fabric()
live = "FABRICLITE_FT_GROUP" in os.environ
group = int(os.environ.get("FABRICLITE_FT_GROUP", fabric.global_rank))  # plain ddp (the benchmark's baseline): the rank
#: the rank inside the replica group and the group's ranks (--devices); plain ddp: every rank its own "group"
group_rank, ranks_per_group = (fabric.global_rank, fabric.world_size) if live else (0, 1)
data_rank = group * ranks_per_group + group_rank  # this rank's share of the data among every group's ranks
name = str(group) if group_rank == 0 else f"{group}.{group_rank}"  # group rank 0's files keep the group's name
torch.manual_seed(1234 + group)  # different initial weights per group: init_sync must make them equal
width, batch = int(os.environ.get("FT_WIDTH", "32")), int(os.environ.get("FT_BATCH", "32"))  # the benchmark's sizes
model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
if group == int(os.environ.get("FT_DELAY_GROUP", "-1")) and fabric.restart_count == 0:
    time.sleep(float(os.environ.get("FT_DELAY_S", "0")))  # this group starts its Manager (and first quorum) late
if fabric.restart_count > 0 and group_rank == 0:  # its Manager (and this round's manager_addr) comes late
    time.sleep(float(os.environ.get("FT_DELAY_RESTARTED_RANK0_S", "0")))
model, optimizer = fabric.setup(model, optimizer)
state = {"model": model, "optimizer": optimizer, "step": 0}
if os.environ.get("FT_PARAM_STATE"):  # a Parameter in the state a healing group receives (PGTransport refuses them)
    state["scale"] = nn.Parameter(torch.full((3,), 1.0 + group))
log = open(os.path.join(out, f"steps-{name}.txt"), "a", buffering=1)
save_every = int(os.environ.get("FT_SAVE_EVERY", "0"))  # 0: never save (a healed state then comes from a peer)
checkpoints = os.path.join(out, f"checkpoints-{group}")  # each group its own directory
source = fabric.load_latest(checkpoints, state)
log.write(f"start {fabric.restart_count} {state['step']} {time.time():.4f} {source}\n")
if fabric.restart_count == 0:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, f"initial-{name}.pt"))
log.write(f"process {fabric.restart_count} {STARTED:.4f} {os.environ['RANK']} {os.environ['WORLD_SIZE']}\n")
dies = group in kill_groups and group_rank == int(os.environ.get("FT_KILL_RANK", "0")) and \
    fabric.restart_count < kill_rounds
#: "round:group rank:where:step,...": in that restart round, that rank of FT_KILL_GROUP dies there (instead of the above)
for entry in [e.split(":") for e in os.environ.get("FT_KILL_PLAN", "").split(",") if e]:
    dies = False
    if group in kill_groups and int(entry[0]) == fabric.restart_count and int(entry[1]) == group_rank:
        dies, kill_where, kill_step = True, entry[2], int(entry[3])
        break


hang_group = int(os.environ.get("FT_HANG_GROUP", "-1"))
hang_step = int(os.environ.get("FT_HANG_STEP", "-1"))


def hang() -> None:
    if group == hang_group and fabric.restart_count == 0 and state["step"] >= hang_step:
        time.sleep(10_000)  # FT-HANG: this group's rank is stuck in user code; its supervisor finds it hung


def die(where: str) -> None:
    if dies and kill_where == where and state["step"] >= kill_step:
        if where == "allreduce":
            time.sleep(0.3)  # the other groups are inside the all-reduce by now
        os.kill(os.getpid(), signal.SIGKILL)


done = 0


def finished() -> bool:
    """Whether to stop now; the ranks of one group (or of a plain ddp job) agree on it."""
    stop = state["step"] >= steps and done > 0 and all_back()
    if fabric.world_size > 1:
        stop = bool(fabric.all_reduce(torch.tensor(float(stop)), reduce_op="max").item())
    return stop


while not finished():
    optimizer.zero_grad()
    gen = torch.Generator().manual_seed(100_000 * data_rank + state["step"])
    x = torch.randn(batch, 16, generator=gen)
    loss = ((model(x) - x.sum(1, keepdim=True).tanh()) ** 2).mean()
    die("allreduce")
    if dies and kill_where == "backward" and state["step"] >= kill_step:  # dies inside backward: the first layer's
        next(model.parameters()).register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))  # (last) gradient
    fabric.backward(loss)
    if state["step"] == 0 and os.environ.get("FT_SAVE_GRAD"):  # the first step's applied (averaged) gradient
        torch.save({n: p.grad.detach().clone() for n, p in model.named_parameters()},
                   os.path.join(out, f"grad-{name}.pt"))
    committed = optimizer.step() is not False  # --fault-tolerant: whether the quorum committed; ddp: None
    if committed:
        state["step"] += 1
        done += 1
        if save_every and state["step"] % save_every == 0:
            fabric.save(os.path.join(checkpoints, f"step-{state['step']:04d}.ckpt"), state, keep=2)
            log.write(f"saved {state['step']} {time.time():.4f}\n")
    log.write(f"{state['step']} {time.time():.4f} {int(bool(committed))}\n")
    die("between")
    hang()
    time.sleep(pace)

torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, f"final-{name}.pt"))
if os.environ.get("FT_SAVE_OPT"):  # the optimizer state, the plain values and the DDP buckets this rank ended with
    ddp = getattr(model, "_forward_module", None)
    logging = ddp._get_ddp_logging_data() if hasattr(ddp, "_get_ddp_logging_data") else {}
    torch.save({"optimizer": optimizer.state_dict(), "step": state["step"], "scale": state.get("scale"),
                "buckets": (logging.get("bucket_sizes"), logging.get("rebuilt_bucket_sizes"))},
               os.path.join(out, f"optim-{name}.pt"))
log.write(f"end {state['step']} {time.time():.4f}\n")
