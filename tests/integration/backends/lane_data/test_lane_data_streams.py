"""data lane: litdata, MosaicML Streaming and webdataset through ``setup_dataloaders`` and ``fabric.save`` /
``fabric.load``, on real ranks (gloo) with real DataLoader workers, each dataset written on local files with the
library's own writer (``library_data``).

Each attempt runs ``stream_data.train`` on the ranks of a shared pool (2 or 3 ranks): the loop logs each sample it
consumed with its epoch and step (``sample_accounting``), saves at one step and stops a few steps later (a job killed
after its checkpoint); the next attempt loads that checkpoint. litdata and Streaming keep their own position, so every
move resumes from it: at the same sizes exactly; at another world size or number of workers with every sample of the
epoch once, plus at most W' - 1 repeats, and every rank the same number of batches (Streaming from any position, the
padding counted in the warning; litdata from whole rounds of the new sizes' batches, else StreamPositionError).
webdataset has no state of its own: replayed at the same sizes, StreamPositionError at another.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any, Dict, List

import pytest
import torch

from library_data import write_datasets
from sample_accounting import account, check_epochs
from stream_data import train

LENGTH, BATCH, WORKERS, EPOCHS = 96, 4, 2, 2

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def base(tmp_path_factory: Any) -> str:
    """A folder whose ``data`` holds each library's dataset of 96 samples (8 chunks / shards / tars); each case
    runs in a folder of its own next to it (``stream_data.train`` reads ``<case>/../data``)."""
    root = str(tmp_path_factory.mktemp("library_data"))
    write_datasets(os.path.join(root, "data"), LENGTH)
    return root


def case(base: str, name: str) -> str:
    path = os.path.join(base, name)
    os.makedirs(path)
    return path


def attempt(pool: Any, kind: str, directory: str, name: str, **options: Any) -> List[Dict[str, Any]]:
    results = pool.run(train, kind, directory, name, LENGTH, BATCH, options.pop("workers", WORKERS),
                       options.pop("epochs", EPOCHS), options.pop("save_at", None), options.pop("stop_at", None),
                       options.pop("resume", None))
    return results


def checkpoint(directory: str) -> str:
    return os.path.join(directory, "checkpoint.pt")


def repeats_within(directory: str, bound: int) -> Dict[int, List[int]]:
    """Each epoch's samples consumed twice; every sample consumed at least once and at most ``bound`` repeats."""
    accounting = account(directory)
    extra = {e: sorted(i for i, c in counts.items() for _ in range(c - 1)) for e, counts in accounting.epochs.items()}
    check_epochs(accounting, LENGTH, EPOCHS, extra)
    for epoch, repeated in extra.items():
        assert len(repeated) <= bound, f"epoch {epoch}: {len(repeated)} samples repeated ({repeated}), more than {bound}"
    return extra


def same_batches(results: List[Dict[str, Any]], epoch: int = 0) -> None:
    counts = [r["epoch_batches"].get(epoch) for r in results]
    assert len(set(counts)) == 1, f"the ranks yielded unequal numbers of batches in epoch {epoch}: {counts}"


def plain_state(directory: str) -> Dict[str, Any]:
    """The loader's state, loaded with weights_only=True (the adapters' states are plain)."""
    return torch.load(checkpoint(directory), weights_only=True)["loader"]


LIBRARIES = ["litdata", "streaming"]


@pytest.mark.parametrize("library", LIBRARIES)
def test_same_size_resumes_exactly_from_the_library_state(pool2: Any, base: str, library: str) -> None:
    """2 ranks x 2 workers -> the same: every sample once, from the library's own state (no replay, no wrapper:
    litdata's StreamingDataLoader keeps calling its dataset's own methods)."""
    directory = case(base, f"same-{library}")
    attempt(pool2, library, directory, "a0", save_at=5, stop_at=7)
    results = attempt(pool2, library, directory, "a1", resume=checkpoint(directory))
    assert all(r["error"] is None for r in results), results
    check_epochs(account(directory), LENGTH, EPOCHS, {e: [] for e in range(EPOCHS)})
    assert not any("replay" in w for r in results for w in r["warnings"]), results
    state = plain_state(directory)
    assert state["stream"] == library and state["library"]["kind"] == library and state["batch"] == 5, state


@pytest.mark.parametrize("library,first,second", [("litdata", "pool2", "pool3"), ("streaming-shuffled", "pool2",
                                                                                     "pool3"),
                                                  ("litdata-shuffled", "pool3", "pool2"), ("streaming", "pool3",
                                                                                         "pool2")])
def test_another_world_size_sees_every_sample_once(request: Any, base: str, library: str, first: str,
                                                   second: str) -> None:
    """2 -> 3 and 3 -> 2 ranks (with shuffle=True in one direction each), saved at a whole number of the new
    size's rounds of batches (batch 3 of 2 x 4 = 24 samples = 3 ranks x 2 workers x 4; batch 4 of 3 x 4 = 48 = 3 x
    2 ranks x 2 workers x 4): the
    library's elastic resume; every sample of the epoch once plus at most W' - 1 repeats; every rank the same number
    of batches; one warning names the move."""
    a, b = request.getfixturevalue(first), request.getfixturevalue(second)
    directory = case(base, f"world-{library}-{a.world_size}-{b.world_size}")
    save = 3 if a.world_size == 2 else 4
    attempt(a, library, directory, "a0", save_at=save, stop_at=save + 2)
    results = attempt(b, library, directory, "a1", resume=checkpoint(directory))
    assert all(r["error"] is None for r in results), results
    repeats_within(directory, b.world_size - 1)
    same_batches(results)
    assert any(f"saved by {a.world_size} ranks x 2 workers and this run has {b.world_size} ranks x 2 workers" in w
               for w in results[0]["warnings"]), results[0]["warnings"]


@pytest.mark.parametrize("library", ["litdata-shuffled", "streaming-shuffled"])
def test_another_number_of_workers(pool2: Any, base: str, library: str) -> None:
    """2 -> 3 workers per rank, shuffle=True, saved at batch 3 (24 samples = 2 ranks x 3 workers x 4): every sample
    once plus at most W' - 1 repeats."""
    directory = case(base, f"workers-{library}")
    attempt(pool2, library, directory, "a0", save_at=3, stop_at=5)
    results = attempt(pool2, library, directory, "a1", resume=checkpoint(directory), workers=3)
    assert all(r["error"] is None for r in results), results
    repeats_within(directory, 1)
    same_batches(results)


@pytest.mark.parametrize("library", LIBRARIES)
def test_two_resumes_in_a_row_then_a_save_at_the_epoch_end(pool2: Any, pool3: Any, base: str, library: str) -> None:
    """2 ranks (saved at batch 3: 24 samples) -> 3 ranks (resumed, saved two batches later: 48 samples) -> 2 ranks:
    each resume continues where the run before saved. Then a save at the last batch of an epoch (12 batches at 2
    ranks) resumes with the next epoch, whole."""
    directory = case(base, f"twice-{library}")
    attempt(pool2, library, directory, "a0", save_at=3, stop_at=5)
    attempt(pool3, library, directory, "a1", resume=checkpoint(directory), save_at=5, stop_at=7)
    results = attempt(pool2, library, directory, "a2", resume=checkpoint(directory))
    assert all(r["error"] is None for r in results), results
    repeats_within(directory, 2)
    same_batches(results)
    directory = case(base, f"end-{library}")
    attempt(pool2, library, directory, "a0", save_at=12, stop_at=12)
    assert plain_state(directory)["epoch"] == 1 and plain_state(directory)["batch"] == 0
    results = attempt(pool2, library, directory, "a1", resume=checkpoint(directory))
    accounting = account(directory)
    check_epochs(accounting, LENGTH, EPOCHS, {e: [] for e in range(EPOCHS)})
    assert 1 in accounting.sequences[("a1", 0)] and 0 not in accounting.sequences[("a1", 0)], accounting.sequences


def test_a_streaming_epoch_start_reads_no_other_ranks_half_written_state(pool2: Any, base: str) -> None:
    """Resumed at the start of epoch 1 (saved at the last batch of epoch 0) with a fresh Streaming dataset, while the
    node's shared resume block is made and not yet written (another rank's load_state_dict in between; CI's flaky
    hang): no rank reads that block to start the epoch (a read there fails on that rank, and the others' workers
    wait for its in Streaming's node barrier for ever). Both ranks run epoch 1 whole."""
    directory = case(base, "blank-streaming")
    attempt(pool2, "streaming", directory, "a0", save_at=12, stop_at=12)
    results = pool2.run(train, "streaming", directory, "a1", LENGTH, BATCH, WORKERS, EPOCHS, None, None,
                        checkpoint(directory), False, 8, False, True)
    assert all(r["error"] is None for r in results), results
    check_epochs(account(directory), LENGTH, EPOCHS, {e: [] for e in range(EPOCHS)})
    same_batches(results, 1)


def test_webdataset_replays_at_the_same_size_and_refuses_another(pool2: Any, pool3: Any, base: str) -> None:
    """A wds.WebDataset (resampled=False, shardshuffle=False, split by node and worker) has no state of its own: at
    the same sizes its first batches are replayed (the warning says so), each sample once; at 3 ranks its position
    cannot be carried over: StreamPositionError before the first batch, naming both sizes."""
    directory = case(base, "wds-same")
    attempt(pool2, "wds", directory, "a0", save_at=3, stop_at=5)
    results = attempt(pool2, "wds", directory, "a1", resume=checkpoint(directory))
    assert all(r["error"] is None for r in results), results
    check_epochs(account(directory), LENGTH, EPOCHS, {e: [] for e in range(EPOCHS)})
    assert any("its first 3 batches of this epoch are replayed" in w for w in results[0]["warnings"]), results
    results = attempt(pool3, "wds", directory, "a2", resume=checkpoint(directory))
    error = results[0]["error"]
    assert error and error.startswith("StreamPositionError") and "2 ranks x 2 workers" in error \
        and "3 ranks x 2 workers" in error, results


def test_webdataset_two_resumes_in_a_row_then_a_save_at_the_epoch_end(pool2: Any, base: str) -> None:
    """webdataset at the same sizes: saved at batch 3, resumed (replayed) and saved again at batch 6, resumed again:
    every sample once. Then a save at the last batch of an epoch (12 batches): fabriclite cannot tell a stream
    without a state is at its end, so the position is batch 12 of epoch 0, replayed (the warning says so), and the
    next epoch follows whole."""
    directory = case(base, "wds-twice")
    attempt(pool2, "wds", directory, "a0", save_at=3, stop_at=4)
    attempt(pool2, "wds", directory, "a1", resume=checkpoint(directory), save_at=6, stop_at=7)
    results = attempt(pool2, "wds", directory, "a2", resume=checkpoint(directory))
    assert all(r["error"] is None for r in results), results
    check_epochs(account(directory), LENGTH, EPOCHS, {e: [] for e in range(EPOCHS)})
    assert any("its first 6 batches of this epoch are replayed" in w for w in results[0]["warnings"]), results
    directory = case(base, "wds-end")
    attempt(pool2, "wds", directory, "a0", save_at=12, stop_at=12)
    assert plain_state(directory)["epoch"] == 0 and plain_state(directory)["batch"] == 12, plain_state(directory)
    results = attempt(pool2, "wds", directory, "a1", resume=checkpoint(directory))
    accounting = account(directory)
    check_epochs(accounting, LENGTH, EPOCHS, {e: [] for e in range(EPOCHS)})
    assert 1 in accounting.sequences[("a1", 0)] and 0 not in accounting.sequences[("a1", 0)], accounting.sequences
    assert any("its first 12 batches of this epoch are replayed" in w for w in results[0]["warnings"]), results


def wrong_ranks(fabric: Any, library: str, root: str) -> str:
    """Build ``library``'s dataset as if on a single process (the variables it reads say rank 0 of 1), then set
    its loader up: the error's text."""
    from library_data import library_loader

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    try:
        loader = library_loader(library, root, BATCH, 0, {"batch_size": BATCH})
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    try:
        fabric.setup_dataloaders(loader)
    except ValueError as error:
        return str(error)
    return ""


def test_a_litdata_position_between_global_batches_of_the_new_size_raises(pool2: Any, pool3: Any,
                                                                         base: str) -> None:
    """litdata: saved at batch 5 of 2 ranks (40 samples), resumed at 3 ranks (global batches of 12): litdata rounds
    the position down to its global batch and would repeat the samples past it, so StreamPositionError before the
    first batch, naming both sizes and a batch that moves."""
    directory = case(base, "between-litdata")
    attempt(pool2, "litdata", directory, "a0", save_at=5, stop_at=5)
    results = attempt(pool3, "litdata", directory, "a1", resume=checkpoint(directory))
    error = results[0]["error"]
    assert error and error.startswith("StreamPositionError"), results
    for part in ("2 ranks x 2 workers", "3 ranks x 2 workers", "40 samples into the epoch", "a multiple of 3 (at 2",
                 "4 x 3 x 2 = 24"):
        assert part in error, f"{part!r} not in {error!r}"


def named_padding(results: List[Dict[str, Any]]) -> int:
    """The padding the one elastic warning counts (rank 0's)."""
    found = [re.search(r"(\d+) samples? repeated as padding", w) for w in results[0]["warnings"]]
    counts = [int(f.group(1)) for f in found if f]
    assert len(counts) == 1, results[0]["warnings"]
    return counts[0]


@pytest.mark.parametrize("library,first,second,workers", [("streaming-shuffled", "pool2", "pool3", 2),
                                                          ("streaming", "pool3", "pool2", 2),
                                                          ("streaming-shuffled", "pool2", "pool2", 3)])
def test_streaming_resumes_from_any_position_at_another_size(request: Any, base: str, library: str, first: str,
                                                             second: str, workers: int) -> None:
    """MosaicML Streaming at another world size (2 -> 3, 3 -> 2) or number of workers (2 -> 3), saved at batch 5:
    not a whole round of the new size's batches (40 samples at 2 ranks; 60 at 3). Streaming drops exactly the samples
    consumed and deals the rest by samples: every sample of the epoch once, plus the padding the warning counts (at
    most W' - 1), every rank the same number of batches."""
    a, b = request.getfixturevalue(first), request.getfixturevalue(second)
    directory = case(base, f"any-{library}-{a.world_size}-{b.world_size}-{workers}")
    attempt(a, library, directory, "a0", save_at=5, stop_at=6)
    results = attempt(b, library, directory, "a1", resume=checkpoint(directory), workers=workers)
    assert all(r["error"] is None for r in results), results
    padding = named_padding(results)
    extra = repeats_within(directory, b.world_size - 1)
    assert len(extra[0]) == padding and all(not e for epoch, e in extra.items() if epoch), (extra, padding)
    same_batches(results)


def test_streaming_two_resumes_in_a_row_between_rounds(pool2: Any, pool3: Any, base: str) -> None:
    """Streaming, 2 ranks (saved at batch 5: 40 samples) -> 3 ranks (saved one batch later: 52 samples, not a round
    of either size) -> 2 ranks: every sample once plus the padding of each move (at most 2 + 1)."""
    directory = case(base, "any-twice-streaming")
    attempt(pool2, "streaming-shuffled", directory, "a0", save_at=5, stop_at=6)
    attempt(pool3, "streaming-shuffled", directory, "a1", resume=checkpoint(directory), save_at=6, stop_at=7)
    results = attempt(pool2, "streaming-shuffled", directory, "a2", resume=checkpoint(directory))
    assert all(r["error"] is None for r in results), results
    repeats_within(directory, 3)
    same_batches(results)


def test_a_litdata_dataset_that_sees_other_ranks_is_refused(pool2: Any, base: str) -> None:
    """A litdata dataset built for 1 rank (WORLD_SIZE=1 when it was built) on a 2-rank job would give each rank the
    whole epoch: setup_dataloaders refuses it, naming what litdata reads and the fix. (Streaming built so fails in
    its own shared memory before fabriclite sees it.)"""
    errors = pool2.run(wrong_ranks, "litdata", os.path.join(base, "data"))
    assert "shards its samples for rank 1 of 1" in errors[1] and "rank 1 of 2" in errors[1], errors
    assert "after fabric.launch()" in errors[1] and "WORLD_SIZE, GLOBAL_RANK and NNODES" in errors[1], errors


def test_import_fabriclite_imports_none_of_the_libraries() -> None:
    code = ("import sys, fabriclite, fabriclite.data.library_streams, fabriclite.data.streams\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('litdata', 'streaming', 'webdataset')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
