"""Streams resumed on real ranks with real DataLoader workers (issue 36): each loader kind at the same world size, at
2 -> 3 and 3 -> 2 ranks, and at another number of workers; the three anchor bugs; the error for each kind whose
position cannot be carried over.

Every attempt runs ``stream_data.train`` on the ranks of a shared pool: the loop logs each sample it consumed with its
epoch and step (``sample_accounting``), saves at one step and stops a few steps later (a job killed after its
checkpoint); the next attempt loads that checkpoint. The accounting then checks each epoch's 96 samples consumed once,
apart from the padding a dealt epoch names (a rank repeats the start of its share), and that the error, where one is
due, came before the first batch and names both sizes and the opt-out.
"""
from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional

import pytest
import torch

from sample_accounting import account, check_epochs, distributed_sampler_shares
from stream_data import train

LENGTH, BATCH, WORKERS, EPOCHS = 96, 4, 2, 2

pytestmark = pytest.mark.timeout(240)


def attempt(pool: Any, kind: str, directory: str, name: str, **options: Any) -> List[Dict[str, Any]]:
    options.setdefault("workers", WORKERS)
    return pool.run(train, kind, directory, name, LENGTH, BATCH, options.pop("workers"), options.pop("epochs", EPOCHS),
                    options.pop("save_at", None), options.pop("stop_at", None), options.pop("resume", None),
                    options.pop("persistent", False), options.pop("shards", 8), options.pop("ignore", False))


def checkpoint(directory: str) -> str:
    return os.path.join(directory, "checkpoint.pt")


def padding_of(accounting: Any, name: str, epoch: int) -> List[int]:
    """The samples ranks of attempt ``name`` repeated in ``epoch``: what a rank consumed again is the start of its
    share (stream_resume's padding: a rank short by one repeats its first example; the workers' batches may hand it
    out before another worker's last one); anything else fails."""
    repeats: List[int] = []
    for (attempt_name, _), per_epoch in accounting.sequences.items():
        if attempt_name != name or epoch not in per_epoch:
            continue
        sequence = per_epoch[epoch]
        again = [index for i, index in enumerate(sequence) if index in sequence[:i]]
        share = list(dict.fromkeys(sequence))
        assert sorted(again) == sorted(share[:len(again)]), \
            f"{name}: the repeats {again} are not the start of the share {share}"
        repeats += again
    return sorted(repeats)


def map_padding(world: int, epochs: range) -> Dict[int, List[int]]:
    """DistributedSampler's own padding at a fixed world size (96 divides by 2 and 3: none)."""
    return {e: sorted(i for share in distributed_sampler_shares(LENGTH, world, e, 0) for i in share[LENGTH // world:])
            for e in epochs}


def run_pair(first: Any, second: Any, kind: str, directory: str, save_at: int, stop_at: int,
             **second_options: Any) -> List[Dict[str, Any]]:
    attempt(first, kind, directory, "a0", save_at=save_at, stop_at=stop_at, **second_options.pop("first_options", {}))
    return attempt(second, kind, directory, "a1", resume=checkpoint(directory), **second_options)


# ---------------------------------------------------------------------- exactly once, each kind, each move

SAME = ["map", "torchdata", "stateful", "stateless", "hf"]


@pytest.mark.parametrize("kind,workers", [(kind, WORKERS) for kind in SAME] + [("stateful", 0), ("hf", 0),
                                                                                ("hf-shuffled", WORKERS)])
def test_same_size_resumes_exactly_once(pool2: Any, tmp_path: Any, kind: str, workers: int) -> None:
    """2 ranks x 2 workers (or none) -> the same: every kind exactly once; a stateful kind from its own states (no
    replay), a stateless one by replay with a warning naming the replayed batches."""
    results = run_pair(pool2, pool2, kind, str(tmp_path), save_at=5, stop_at=7, workers=workers,
                       first_options={"workers": workers})
    assert all(r["error"] is None for r in results), results
    accounting = account(str(tmp_path))
    check_epochs(accounting, LENGTH, EPOCHS, {e: [] for e in range(EPOCHS)})
    saved = torch.load(checkpoint(str(tmp_path)), weights_only=False)["loader"]
    assert ("torchdata" in saved) == (kind == "torchdata"), saved  # torchdata's own state_dict, per rank
    assert ("ranks" in saved) == (kind in ("stateful", "hf")), saved  # every rank's per-worker states
    replays = [w for w in results[0]["warnings"] if "replayed" in w]
    if kind in ("stateless", "hf-shuffled"):  # a shuffle buffer's state loses its contents: replayed
        assert replays and "its first 5 batches of this epoch are replayed" in replays[0], results[0]["warnings"]
    else:
        assert not replays, replays


@pytest.mark.parametrize("kind,first,second,save", [("hf", "pool2", "pool3", 3), ("hf", "pool2", "pool3", 5),
                                                    ("hf", "pool3", "pool2", 3), ("map", "pool2", "pool3", 3),
                                                    ("torchdata", "pool3", "pool2", 3)])
def test_another_world_size_deals_the_rest(request: Any, tmp_path: Any, kind: str, first: str, second: str,
                                           save: int) -> None:
    """2 -> 3 and 3 -> 2 ranks: the epoch's rest dealt again, each sample once apart from at most W' - 1 padding
    samples, named (Hugging Face, 8 shards, 2 -> 3 at batch 5: 56 examples left over 3 ranks, one rank short by one
    repeats its first), every rank the same number of batches."""
    a, b = request.getfixturevalue(first), request.getfixturevalue(second)
    results = run_pair(a, b, kind, str(tmp_path), save_at=save, stop_at=save + 2)
    assert all(r["error"] is None for r in results), results
    accounting = account(str(tmp_path))
    repeats = padding_of(accounting, "a1", 0)
    check_epochs(accounting, LENGTH, EPOCHS, {0: repeats, 1: []})
    assert len(repeats) <= b.world_size - 1, f"{len(repeats)} repeats at {b.world_size} ranks: {repeats}"
    if kind == "hf" and save == 5:
        assert len(repeats) == 1, repeats  # 56 % 3 = 2: one rank short by one
    if repeats:
        assert any(f"{len(repeats)} repeated as padding" in w for w in results[0]["warnings"]), results[0]["warnings"]
    batches = {r["epoch_batches"].get(0) for r in results}
    assert len(batches) == 1, f"the ranks yielded unequal numbers of batches in the resumed epoch: {results}"


def test_hf_another_number_of_workers(pool2: Any, tmp_path: Any) -> None:
    """Hugging Face shards, 2 workers -> 3 workers per rank: every example once, at most W' - 1 = 1 repeated as
    padding (named), every rank the same number of batches."""
    results = run_pair(pool2, pool2, "hf", str(tmp_path), save_at=3, stop_at=4, workers=3)
    assert all(r["error"] is None for r in results), results
    accounting = account(str(tmp_path))
    repeats = padding_of(accounting, "a1", 0)
    check_epochs(accounting, LENGTH, EPOCHS, {0: repeats, 1: []})
    assert len(repeats) <= 1, repeats
    assert len({r["epoch_batches"].get(0) for r in results}) == 1, results


# ---------------------------------------------------------------------- the part-1 error

@pytest.mark.parametrize("kind,first,second,workers,why", [
    ("stateful", "pool2", "pool3", 2, "shards the stream another way"),
    ("stateless", "pool3", "pool2", 2, "has no state"),
    ("stateful", "pool2", "pool2", 1, "another number of workers"),
    ("hf-shuffled", "pool2", "pool3", 2, "shuffle buffer"),
    ("hf-own", "pool2", "pool3", 2, "not split with datasets.distributed.split_dataset_by_node"),
])
def test_position_that_cannot_move_raises(request: Any, tmp_path: Any, kind: str, first: str, second: str,
                                          workers: int, why: str) -> None:
    """A position that cannot be carried over raises before the first batch, naming both sizes, why, the fix and
    the opt-out; with the opt-out the epoch's stream starts over."""
    a, b = request.getfixturevalue(first), request.getfixturevalue(second)
    results = run_pair(a, b, kind, str(tmp_path), save_at=3, stop_at=3, workers=workers)
    error = results[0]["error"]
    assert error and error.startswith("StreamPositionError"), results
    saved, now = f"{a.world_size} ranks x 2 workers", f"{b.world_size} ranks x {workers} worker"
    for part in (saved, now, "batch 3 of epoch 0", why, "loader.ignore_stream_position()", "loader.set_epoch(0)"):
        assert part in error, f"{part!r} not in {error!r}"
    assert all(not os.path.exists(os.path.join(str(tmp_path), f"a1.rank{r}.log")) or
               os.path.getsize(os.path.join(str(tmp_path), f"a1.rank{r}.log")) == 0 for r in range(b.world_size))
    opted = attempt(b, kind, str(tmp_path), "a2", resume=checkpoint(str(tmp_path)), workers=workers, ignore=True,
                    epochs=1)
    assert all(r["error"] is None and r["epoch_batches"].get(0) for r in opted), opted


def test_hf_fewer_shards_than_ranks_times_workers(pool2: Any, pool3: Any, tmp_path: Any) -> None:
    """4 shards dealt at 2 ranks x 2 workers cannot be dealt over 3 x 2 = 6 slots: the error says so."""
    results = run_pair(pool2, pool3, "hf", str(tmp_path), save_at=2, stop_at=2, shards=4)
    error = results[0]["error"]
    assert error and "fewer than ranks x workers = 3 x 2 = 6" in error, results


# ---------------------------------------------------------------------- the anchor bugs

@pytest.mark.parametrize("kind", ["stateful", "hf"])
def test_persistent_workers_later_epochs_complete(pool2: Any, tmp_path: Any, kind: str) -> None:
    """datasets #7447: after a resume with persistent_workers=True, the later epochs are whole, not the remainder."""
    run_pair(pool2, pool2, kind, str(tmp_path), save_at=8, stop_at=9, persistent=True, epochs=3,
             first_options={"persistent": True})
    check_epochs(account(str(tmp_path)), LENGTH, 3, {e: [] for e in range(3)})


@pytest.mark.parametrize("kind", ["stateful", "torchdata", "hf"])
def test_state_at_the_end_of_an_epoch_keeps_the_next(pool2: Any, tmp_path: Any, kind: str) -> None:
    """torchdata #1437: a state taken at the last batch of an epoch (12 at 2 ranks) resumes with the next epoch,
    whole."""
    run_pair(pool2, pool2, kind, str(tmp_path), save_at=12, stop_at=12)
    accounting = account(str(tmp_path))
    check_epochs(accounting, LENGTH, EPOCHS, {e: [] for e in range(EPOCHS)})
    assert 1 in accounting.sequences[("a1", 0)], "the resumed attempt consumed nothing of epoch 1"


@pytest.mark.parametrize("kind,second", [("stateful", "pool2"), ("hf", "pool2"), ("hf", "pool3")])
def test_second_resume_continues(request: Any, pool2: Any, tmp_path: Any, kind: str, second: str) -> None:
    """datasets #8308: a second resume continues where the first resumed run saved (one step after it resumed,
    before some workers handed out a batch again), not from the start of the stream."""
    directory, other = str(tmp_path), request.getfixturevalue(second)
    attempt(pool2, kind, directory, "a0", save_at=4, stop_at=6)
    attempt(other, kind, directory, "a1", resume=checkpoint(directory), save_at=5, stop_at=7)
    results = attempt(other, kind, directory, "a2", resume=checkpoint(directory))
    accounting = account(directory)
    # a dealt epoch's padding (a rank one example short repeats its first, consumed by a1) ends a2's share
    repeats = sorted(i for i, c in accounting.epochs[0].items() for _ in range(c - 1))
    check_epochs(accounting, LENGTH, EPOCHS, {0: repeats, 1: []})
    assert len(repeats) <= other.world_size - 1, repeats
    if repeats:
        assert any(f"{len(repeats)} repeated as padding" in w for w in results[0]["warnings"]), results


@pytest.mark.parametrize("kind", ["stateful", "hf"])
def test_same_size_resume_keeps_the_order(pool2: Any, tmp_path: Any, kind: str) -> None:
    """Saved after 5 batches (worker 0's turn came 3 times, worker 1's twice), the resumed run asks worker 1 first, as
    an uninterrupted run would: every rank's batches come in the uninterrupted order."""
    reference, directory = str(tmp_path / "reference"), str(tmp_path / "resumed")
    attempt(pool2, kind, reference, "a0")
    run_pair(pool2, pool2, kind, directory, save_at=5, stop_at=7)
    whole, parts = account(reference).sequences, account(directory).sequences
    for rank in range(2):
        for epoch in range(EPOCHS):
            resumed = parts[("a0", rank)].get(epoch, []) + parts[("a1", rank)].get(epoch, [])
            assert resumed == whole[("a0", rank)][epoch], (rank, epoch)
