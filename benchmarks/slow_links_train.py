"""The training script of benchmarks/slow_links.py, one rank per node (a replica group under --fault-tolerant):
a small causal transformer language model (~2.2 M parameters) on synthetic tokens, AdamW inside, the same loop for
every scheme (``fabriclite run`` chooses it: plain ddp, ``--fault-tolerant``, ``--strategy local_sgd|diloco``).

Synthetic tokens: each sequence follows a fixed random permutation of the vocabulary (token t+1 = perm[token t])
with 10 % of the tokens replaced at random, so a model can learn it (loss from ln 2048 = 7.6 towards ~1).

    fabriclite run ... slow_links_train.py OUT STEPS

writes ``OUT/summary-<group>.json``: per step (after the iteration) its end time, loss and whether a sync happened
in it; the bytes this node sent on eth0 (``tc -s qdisc``) at the end of warm-up and at the end; the eval loss of
the final model on a fixed held-out batch; and the kill / restart times. ``SL_TIME_CAP`` (s): stop after that long
past warm-up even before STEPS (a ddp run on a slow link). ``SL_KILL_GROUP`` / ``SL_KILL_STEP``: that group's rank
SIGKILLs itself after that step in its first incarnation; the others go on past STEPS until it is back and has
taken part in a sync (its summary's ``resynced``; then every group stops at a multiple of ``sync_every``, as the
lane's script): a group healed past STEPS still makes steps with the others.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import torch
from torch import nn

from fabriclite import Fabric

VOCAB, WIDTH, LAYERS, HEADS, SEQ, BATCH = 2048, 192, 3, 4, 32, 4
WARMUP = 3

out, steps = sys.argv[1], int(sys.argv[2])
cap = float(os.environ.get("SL_TIME_CAP", "1e9"))
kill_group, kill_step = int(os.environ.get("SL_KILL_GROUP", "-1")), int(os.environ.get("SL_KILL_STEP", "-1"))


class LM(nn.Module):
    """A small causal transformer: token and position embeddings, pre-norm encoder layers, a vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.zeros(SEQ, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tokens(x) + self.positions[: x.shape[1]]
        return self.head(self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True))


PERM = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))


def batch(seed: int, size: int = BATCH) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.empty(size, SEQ + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(VOCAB, (size,), generator=gen)
    for t in range(SEQ):
        seqs[:, t + 1] = PERM[seqs[:, t]]
    noise = torch.rand(size, SEQ + 1, generator=gen) < 0.1
    return torch.where(noise, torch.randint(VOCAB, (size, SEQ + 1), generator=gen), seqs)


def loss_of(model: nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    logits = model(seqs[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), seqs[:, 1:].reshape(-1))


def sent_bytes() -> int:
    """Bytes this node's eth0 qdisc has sent (0 outside the benchmark's hosts)."""
    try:
        text = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
    except OSError:
        return 0
    match = re.search(r"Sent (\d+) bytes", text)
    return int(match.group(1)) if match else 0


fabric = Fabric()
group = int(os.environ.get("FABRICLITE_FT_GROUP", fabric.global_rank))
torch.manual_seed(1234)
model = LM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = fabric.setup(model, optimizer)
state = {"model": model, "optimizer": optimizer, "step": 0}
source = fabric.load_latest(os.path.join(out, f"checkpoints-{group}"), state)
settings = getattr(fabric.strategy, "settings", None)
every = settings.sync_every if settings is not None else 1
summary_path = os.path.join(out, f"summary-{group}.json")
summary = json.load(open(summary_path)) if os.path.exists(summary_path) else {"group": group, "rows": []}
summary.setdefault("starts", []).append([fabric.restart_count, state["step"], time.time(), str(source)])
dies = group == kill_group and fabric.restart_count == 0


def synced() -> int:
    return fabric.strategy.sync_state()["manager"]["step"] if settings is not None else -1


def all_back() -> bool:
    if kill_group < 0:
        return True
    path = os.path.join(out, f"summary-{kill_group}.json")
    try:
        return bool(json.load(open(path)).get("resynced"))
    except (OSError, ValueError, KeyError):
        return False


def write() -> None:
    with open(summary_path + ".tmp", "w") as f:
        json.dump(summary, f)
    os.replace(summary_path + ".tmp", summary_path)


if fabric.restart_count > 0:
    write()  # its start, in case it dies again
started, last_sync = None, synced()
while not (state["step"] >= steps and state["step"] % every == 0 and all_back()):
    seqs = batch(1_000_000 * group + state["step"])
    optimizer.zero_grad()
    loss = loss_of(model, seqs)
    fabric.backward(loss)
    committed = optimizer.step() is not False
    if committed:
        state["step"] += 1
    now = synced()
    summary["rows"].append([state["step"], time.time(), loss.item(), settings is None or now != last_sync])
    if fabric.restart_count > 0 and not summary.get("resynced") and (settings is None or now != last_sync):
        summary["resynced"] = time.time()
        write()  # back and in step with the others: they may stop at their next multiple of sync_every
    last_sync = now
    if state["step"] >= WARMUP and started is None:  # a group that joined late: its first step
        started = time.time()
        summary["warm"] = [state["step"], started, sent_bytes()]
    if dies and state["step"] >= kill_step:
        summary["killed"] = time.time()
        write()
        os.kill(os.getpid(), signal.SIGKILL)
    if started is not None and time.time() - started > cap and kill_group < 0:
        summary["capped"] = True
        break

summary["end"] = [state["step"], time.time(), sent_bytes()]
with torch.no_grad():
    summary["eval_loss"] = loss_of(model, batch(-1, 32)).item()
write()
