"""Elastic resume under real ranks: a job of `fabriclite run` at W ranks, killed after a mid-epoch checkpoint, is run
again at W' != W from the same checkpoint directory, and finishes (tests/support/elastic_script.py).

Checked with the sample accounting (tests/support/sample_accounting.py; every rank logs each sample its dataset's
``__getitem__`` loads, with its epoch and step): each sample of each epoch consumed once, apart from padding that is
named (DistributedSampler's own at a fixed world size, computed with torch's sampler; in the resumed epoch, the repeats
the one warning names); the killed attempt's samples count only up to the checkpoint the next attempt resumed from
(and some were past it); every rank of the resumed attempt consumed the same number of samples; the epochs after the
resumed one are exactly torch's DistributedSampler at W'. The weights the second attempt loaded are bit for bit the
ones the first saved at that step (fsdp: resharded from 4 shards to 2 through torch.distributed.checkpoint).

Cases: ddp 3 -> 2 (the epoch's rest, 38 samples, does not divide by W' x B = 8), ddp 2 -> 3 (10 left, padded with 2
repeats), fsdp 4 -> 2 (18 left, not a multiple of 8).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from restart_harness import DEADLINE_S, _env
from sample_accounting import account, check_epochs, distributed_sampler_shares, named_repeats

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * DEADLINE_S + 60)]

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "support",
                      "elastic_script.py")
LENGTH, BATCH, EPOCHS, SEED = 50, 4, 4, 1234


def run(devices: int, env: Dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", str(devices), SCRIPT]
    return subprocess.run(command, env=_env({"LENGTH": str(LENGTH), "BATCH": str(BATCH), "EPOCHS": str(EPOCHS), **env}),
                          capture_output=True, text=True, timeout=DEADLINE_S)


def plain_padding(world: int, epoch: int) -> List[int]:
    """The samples torch's DistributedSampler repeats in a whole epoch at ``world`` ranks."""
    counts: Dict[int, int] = {}
    for share in distributed_sampler_shares(LENGTH, world, epoch, SEED):
        for index in share:
            counts[index] = counts.get(index, 0) + 1
    return sorted(i for i, c in counts.items() for _ in range(c - 1))


@pytest.mark.parametrize("strategy, world, new_world, save_every, kill_at, resumed_epoch, left", [
    ("ddp", 3, 2, 3, "8:1", 1, 38),  # 5 batches an epoch at 3 ranks: step 6 is epoch 1 after 1 batch (12 consumed)
    ("ddp", 2, 3, 5, "6:0", 0, 10),  # 7 batches an epoch at 2 ranks: step 5 is epoch 0 after 5 batches (40 consumed)
    ("fsdp", 4, 2, 3, "7:3", 1, 18),  # 4 batches an epoch at 4 ranks: step 6 is epoch 1 after 2 batches (32 consumed)
])
def test_a_job_killed_at_w_ranks_finishes_at_w_prime_with_exact_sample_accounting(
        tmp_path: Path, strategy, world, new_world, save_every, kill_at, resumed_epoch, left):
    env = {"CKPT_DIR": str(tmp_path / "ckpt"), "ACCOUNT_DIR": str(tmp_path / "account"), "STRATEGY": strategy,
           "SAVE_EVERY": str(save_every)}
    first = run(world, {**env, "ATTEMPT": "a0", "KILL_AT": kill_at})
    assert first.returncode != 0 and f"KILLED at step {kill_at.split(':')[0]}" in first.stdout, first.stderr[-3000:]
    second = run(new_world, {**env, "ATTEMPT": "a1"})
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-5000:]
    resumed_step = (int(kill_at.split(":")[0]) // save_every) * save_every
    saved = dict(re.findall(r"^SAVED (\d+) (\w+)$", first.stdout, re.M))
    loaded = re.search(r"^LOADED (\d+) (\w+)$", second.stdout, re.M)
    assert loaded and int(loaded.group(1)) == resumed_step, second.stdout[-2000:]
    assert loaded.group(2) == saved[str(resumed_step)]  # the model (and its shards) loaded bit for bit

    accounting = account(str(tmp_path / "account"))
    (a0, a1) = accounting.attempts
    assert (a0.world_size, a1.world_size, a1.resumed_step) == (world, new_world, resumed_step)
    assert accounting.discarded > 0  # the killed attempt went past its last checkpoint: those samples do not count
    (message,) = a1.warnings  # one warning: the loader's dealing and the random states
    assert f"saved by {world} ranks and this run has {new_world}: epoch {resumed_epoch} continues after the first " \
           f"{LENGTH - left} of its {LENGTH} samples" in message
    assert f"from {BATCH * world} ({BATCH} x {world} ranks) to {BATCH * new_world} ({BATCH} x {new_world} ranks)" \
        in message
    assert "random states were saved by" in message
    repeats = named_repeats(message)
    assert len(repeats) == -left % new_world  # DistributedSampler's padding of the rest: at most W' - 1
    padding = {epoch: plain_padding(world if epoch < resumed_epoch else new_world, epoch) for epoch in range(EPOCHS)}
    padding[resumed_epoch] = repeats
    check_epochs(accounting, LENGTH, EPOCHS, padding)
    # the resumed epoch's rest: the same number of samples on every rank of the new world size
    rest = [accounting.sequences[("a1", rank)][resumed_epoch] for rank in range(new_world)]
    assert {len(r) for r in rest} == {(left + len(repeats)) // new_world}
    # later epochs: what a run at W' draws, rank by rank, in order
    for epoch in range(resumed_epoch + 1, EPOCHS):
        expected = distributed_sampler_shares(LENGTH, new_world, epoch, SEED)
        assert [accounting.sequences[("a1", rank)][epoch] for rank in range(new_world)] == expected
