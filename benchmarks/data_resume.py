"""The resume wait of a data loader: from loading its state to the first batch, at batch 100, 1,000 and 10,000 of an
epoch, for each loader kind (issue 36), against replay (a fresh iterator whose first batches are produced again and
discarded) and against torchdata's StatefulDataLoader on the same dataset.

    python benchmarks/data_resume.py [--samples 48000] [--batch 4] [--workers 2] [--work-us 100]

writes benchmarks/results/data_resume.md (``--results PATH`` elsewhere). One process (1 rank), 2 DataLoader workers
(fork), batch 4; the datasets hold ``--samples`` >= 10,000 x batch x ranks samples, each costing ``--work-us`` of
sleep to produce (the Hugging Face stream: its own per-example cost); the Hugging Face stream is made of shards of
1,000 examples. Each wait is the best of 5 resumes (replay: one pass); "batch time" is a pass's time per batch. Goals:
the stateful kinds stay flat (the wait at batch 10,000 within the wait at batch 100 plus 2 batch times, plus the
re-read of the current shard for Hugging Face); replay grows linearly.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(__file__))
from common import Results, table  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info  # noqa: E402

POSITIONS = (100, 1_000, 10_000)
SHARD = 1_000
REPEATS = 5


def _work(us: float) -> None:
    if us:
        time.sleep(us / 1e6)


class MapSet(Dataset):
    def __init__(self, length: int, work_us: float) -> None:
        self.length, self.work_us = length, work_us

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        _work(self.work_us)
        return index


class Stream(IterableDataset):
    """Indices dealt over the workers (worker w: w, w + nw, ...), each costing ``work_us``."""

    def __init__(self, length: int, work_us: float) -> None:
        self.length, self.work_us, self.start, self.next = length, work_us, 0, 0

    def __iter__(self) -> Any:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        start, self.start = self.start, 0
        for position, index in enumerate(range(worker, self.length, workers)):
            if position < start:
                continue
            _work(self.work_us)
            self.next = position + 1
            yield index


class StatefulStream(Stream):
    def state_dict(self) -> Dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.start = int(state["next"])


def hf_stream(length: int) -> Any:
    import datasets
    from datasets.distributed import split_dataset_by_node

    data = datasets.Dataset.from_dict({"index": list(range(length))})
    return split_dataset_by_node(data.to_iterable_dataset(num_shards=length // SHARD), rank=0, world_size=1)


def first_index(batch: Any) -> int:
    data = batch["index"] if isinstance(batch, dict) else batch
    return int(torch.as_tensor(data).reshape(-1)[0])


def measure(make: Callable[[], Any], save: Callable[[Any], Any], load: Callable[[Any, Any], None],
            resume: bool = True) -> Tuple[float, Dict[int, float], Dict[int, float]]:
    """One pass from a fresh loader to batch 10,000 + 1, taking the state at each position, then the best of REPEATS
    resumes at each position: ``(batch time s, position -> wait s, position -> replay's wait s)``. The pass is a replay:
    from its start (the workers' too) to the batch after a position is what producing and discarding the batches up
    to it costs; the batch time is the pass's time per batch."""
    states, expected, replayed = {}, {}, {}
    started = time.perf_counter()
    loader = make()
    iterator = iter(loader)
    for batch_number in range(1, POSITIONS[-1] + 2):
        batch = next(iterator)
        if batch_number - 1 in states:
            expected[batch_number - 1] = first_index(batch)
            replayed[batch_number - 1] = time.perf_counter() - started
        if batch_number in POSITIONS:
            states[batch_number] = save(loader)
    per_batch = (time.perf_counter() - started) / (POSITIONS[-1] + 1)
    del iterator, loader
    waits: Dict[int, float] = {}
    for position in POSITIONS if resume else ():
        best = float("inf")
        for _ in range(REPEATS):
            fresh = make()
            began = time.perf_counter()
            load(fresh, states[position])
            batch = next(iter(fresh))
            best = min(best, time.perf_counter() - began)
            assert first_index(batch) == expected[position], (position, first_index(batch), expected[position])
            del fresh
        waits[position] = best
    return per_batch, waits, replayed


def shard_read(length: int) -> float:
    """The time to read one Hugging Face shard of SHARD examples (what resuming inside a shard may re-read)."""
    stream = hf_stream(length).shard(num_shards=length // SHARD, index=0)
    began = time.perf_counter()
    for _ in stream:
        pass
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=48_000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work-us", type=float, default=100.0)
    parser.add_argument("--positions", default="100,1000,10000", help="the batches resumed at (a quick check: fewer)")
    parser.add_argument("--results", default=None, help="the results file (benchmarks/results/data_resume.md)")
    args = parser.parse_args()
    global POSITIONS
    POSITIONS = tuple(int(p) for p in args.positions.split(","))
    if args.samples < POSITIONS[-1] * args.batch + args.batch:
        parser.error(f"--samples must hold at least {POSITIONS[-1]} x batch x ranks samples")
    if len(POSITIONS) != 3:
        parser.error("--positions takes three positions")
    results = Results("data_resume")
    warnings.simplefilter("ignore")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from fabriclite import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    n, work = args.samples, args.work_us
    options = {"batch_size": args.batch, "num_workers": args.workers}
    datasets_of: Dict[str, Callable[[], Any]] = {
        "map-style dataset": lambda: MapSet(n, work),
        "IterableDataset with state_dict": lambda: StatefulStream(n, work),
        f"Hugging Face IterableDataset ({n // SHARD} shards of {SHARD})": lambda: hf_stream(n),
        "IterableDataset without state": lambda: Stream(n, work),
    }

    def fabriclite_loader(dataset: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: fabric.setup_dataloaders(DataLoader(dataset(), **options))

    def torchdata_loader(dataset: Callable[[], Any]) -> Callable[[], Any]:
        return lambda: StatefulDataLoader(dataset(), **options)

    def save(loader: Any) -> Any:
        return loader.state_dict()

    def load(loader: Any, state: Any) -> None:
        loader.load_state_dict(state)

    rows: List[List[str]] = []
    goals: List[str] = []
    reread = shard_read(n)
    for name, dataset in datasets_of.items():
        stateless = "without" in name
        per_batch, waits, replayed = measure(fabriclite_loader(dataset), save, load, resume=not stateless)
        if stateless:  # fabriclite replays it: its wait is replay's
            waits = replayed
        peer = measure(torchdata_loader(dataset), save, load)[1] if not stateless else None
        ms = [f"{waits[p] * 1e3:.1f}" for p in POSITIONS]
        rows.append([name, "fabriclite" + (" (replay)" if stateless else ""), *ms, f"{per_batch * 1e3:.2f}"])
        if not stateless:
            rows.append(["", "replay", *[f"{replayed[p] * 1e3:.1f}" for p in POSITIONS], ""])
            assert peer is not None
            rows.append(["", "torchdata StatefulDataLoader", *[f"{peer[p] * 1e3:.1f}" for p in POSITIONS], ""])
            allowance = 2 * per_batch + (reread if "Hugging" in name else 0.0)
            flat = waits[POSITIONS[-1]] <= waits[POSITIONS[0]] + allowance
            goals.append(f"- [{'x' if flat else ' '}] {name}: flat, the wait at batch {POSITIONS[-1]:,} "
                         f"({waits[POSITIONS[-1]] * 1e3:.1f} ms) within the wait at batch {POSITIONS[0]:,} "
                         f"({waits[POSITIONS[0]] * 1e3:.1f} ms) + 2 batch times ({2 * per_batch * 1e3:.2f} ms)"
                         + (f" + one shard's re-read ({reread * 1e3:.1f} ms)" if "Hugging" in name else ""))
        grows = replayed[POSITIONS[-1]] / replayed[POSITIONS[1]]
        scale = POSITIONS[-1] / POSITIONS[1]
        goals.append(f"- [{'x' if grows >= scale / 2 else ' '}] {name}, replay: grows linearly, the wait at batch "
                     f"{POSITIONS[-1]:,} is {grows:.1f}x the wait at batch {POSITIONS[1]:,} ({scale:g}x batches; goal "
                     f">= {scale / 2:g}x)")
        print(rows[-1], flush=True)
    body = table(["dataset", "resumed by", *[f"wait at {p:,} (ms)" for p in POSITIONS],
                  "batch time (ms)"], rows)
    body += "\n\n" + "\n".join(goals)
    body += ("\n\nThe wait is from `load_state_dict` on a fresh loader to its first batch (starting its 2 workers "
             f"included), the best of {REPEATS}; each resumed first batch is checked against the "
             "uninterrupted pass's. Replay's wait is the time of the uninterrupted pass through fabriclite's loader "
             "from its creation to the batch after the position (what producing and discarding the batches before "
             "costs). "
             "fabriclite's rows go through `fabric.setup_dataloaders` (1 rank): the map-style set skips batches in "
             "the sampler, the stateful stream loads each worker's own state, the Hugging Face stream resumes each "
             "shard from its own state (re-reading the current shard up to its offset), the stream without a state "
             "is replayed.")
    print(body)
    results.write(body, extra=[("dataset", f"{n} samples, batch {args.batch}, {args.workers} workers (fork), "
                                           f"{work:g} us of work per sample (not for Hugging Face); Hugging Face "
                                           f"shards of {SHARD} examples")], path=args.results)


if __name__ == "__main__":
    main()
