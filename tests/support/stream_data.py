"""Streams for resume tests, one per loader kind of issue 36, and the training loop that records what it consumed.

Each stream yields the indices ``0 .. length - 1`` (as ``{"index": i}`` for Hugging Face) once per epoch over the whole
job: ``RankStream`` (a plain ``IterableDataset``) and ``StatefulRankStream`` (the same with ``state_dict`` /
``load_state_dict``) shard by rank and worker themselves, as users write them; ``hf_stream`` is a Hugging Face
``datasets.IterableDataset`` of ``shards`` shards split with ``split_dataset_by_node``; ``torchdata_loader`` is a
torchdata ``StatefulDataLoader`` over a map-style range.

``train(fabric, ...)`` (run on every rank of a pool) is the loop under test: it sets the loader up, loads the
checkpoint when asked, and logs each consumed sample with its epoch and step (``sample_accounting.Recorder``); it saves
at ``save_at`` and stops at ``stop_at`` (a job killed after its checkpoint). A rank's DataLoader workers are real
processes: pool ranks are daemons, which may not have children, so ``allow_workers()`` lifts that in the rank
(the rank still dies with the pool: ``die_with_parent``).
"""
from __future__ import annotations

import multiprocessing
import os
import time
import warnings
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from sample_accounting import Recorder


def allow_workers() -> None:
    """Let this (daemon) pool rank start DataLoader worker processes."""
    multiprocessing.current_process()._config["daemon"] = False  # type: ignore[attr-defined]


class RankStream(IterableDataset):
    """Indices ``0 .. length - 1``, dealt over ranks and workers by the stream itself: worker ``w`` of rank ``r``
    (of ``world`` x ``workers``) yields the indices ``i`` with ``i % (world x workers) == r x workers + w``."""

    def __init__(self, length: int, rank: int, world: int, delay: float = 0.0) -> None:
        self.length, self.rank, self.world, self.delay = length, rank, world, delay

    def _mine(self) -> List[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        slot, slots = self.rank * workers + worker, self.world * workers
        return list(range(slot, self.length, slots))

    def __iter__(self) -> Iterator[int]:
        for index in self._mine():
            if self.delay:
                time.sleep(self.delay)
            yield index


class StatefulRankStream(RankStream):
    """``RankStream`` with torch's ``Stateful`` protocol: its state is the number of its items yielded in the running
    iteration; a loaded state is where the next iteration starts."""

    def __init__(self, length: int, rank: int, world: int, delay: float = 0.0) -> None:
        super().__init__(length, rank, world, delay)
        self.next, self.start = 0, 0

    def __iter__(self) -> Iterator[int]:
        mine, start, self.start = self._mine(), self.start, 0
        self.next = start
        for position in range(start, len(mine)):
            if self.delay:
                time.sleep(self.delay)
            self.next = position + 1
            yield mine[position]

    def state_dict(self) -> Dict[str, int]:
        return {"next": self.next}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.start = int(state["next"])


def hf_stream(length: int, shards: int, rank: int, world: int, **split: Any) -> Any:
    """A Hugging Face IterableDataset of ``{"index": i}``, ``shards`` shards, split for ``rank`` of ``world``."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    data = datasets.Dataset.from_dict({"index": list(range(length))})
    stream = data.to_iterable_dataset(num_shards=shards)
    if split.get("shuffle"):
        stream = stream.shuffle(seed=0, buffer_size=8)
    return split_dataset_by_node(stream, rank=rank, world_size=world)


class Range(Dataset):
    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


def make_loader(kind: str, length: int, batch: int, workers: int, rank: int, world: int,
                persistent: bool = False, shards: int = 8, data_dir: Optional[str] = None) -> DataLoader:
    """The DataLoader of one kind: ``map``, ``stateful``, ``stateless``, ``hf``, ``hf-shuffled``, ``hf-own``
    (a Hugging Face stream sharded by the user with ``.shard``), ``torchdata``; or a streaming library's
    (``library_data.KINDS``, over the datasets written under ``data_dir``)."""
    options: Dict[str, Any] = {"batch_size": batch, "num_workers": workers,
                               "persistent_workers": persistent and workers > 0}
    if workers:
        options["multiprocessing_context"] = "fork"  # pool ranks are spawned: spawned workers would import for seconds
    if kind == "map":
        return DataLoader(Range(length), shuffle=True, **options)
    from library_data import KINDS, library_loader

    if kind in KINDS:
        assert data_dir is not None, "a library's loader reads the datasets written under data_dir"
        return library_loader(kind, data_dir, batch, workers, options)
    if kind == "torchdata":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(Range(length), shuffle=True, **options)
    if kind == "stateful":
        return DataLoader(StatefulRankStream(length, rank, world), **options)
    if kind == "stateless":
        return DataLoader(RankStream(length, rank, world), **options)
    if kind == "hf":
        return DataLoader(hf_stream(length, shards, rank, world), **options)
    if kind == "hf-shuffled":
        return DataLoader(hf_stream(length, shards, rank, world, shuffle=True), **options)
    if kind == "hf-own":
        import datasets

        own = datasets.Dataset.from_dict({"index": list(range(length))}).to_iterable_dataset(num_shards=shards)
        return DataLoader(own.shard(num_shards=world, index=rank), **options)
    raise ValueError(kind)


def indices(batch: Any) -> List[int]:
    data = batch["index"] if isinstance(batch, dict) else batch
    return [int(i) for i in torch.as_tensor(data).reshape(-1)]


def train(fabric: Any, kind: str, directory: str, attempt: str, length: int, batch: int, workers: int,
          epochs: int, save_at: Optional[int] = None, stop_at: Optional[int] = None, resume: Optional[str] = None,
          persistent: bool = False, shards: int = 8, ignore: bool = False,
          blank_resume: bool = False) -> Dict[str, Any]:
    """One attempt of the loop (see the module docstring); returns ``{"resumed_step", "steps", "warnings",
    "error", "epoch_batches"}`` (the error's text when loading raised). ``blank_resume``: rank 0 creates its
    Streaming dataset's shared resume block and leaves it unwritten (``library_data.blank_resume_block``)."""
    allow_workers()
    rank, world = fabric.global_rank, fabric.world_size
    if kind in ("litdata", "litdata-shuffled", "streaming", "streaming-shuffled", "wds"):
        # what fabriclite's launchers set for each rank (the pool's ranks join as a launcher's children would):
        # Streaming and webdataset read them
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(fabric.local_rank),
                          LOCAL_WORLD_SIZE=str(world))
    built = make_loader(kind, length, batch, workers, rank, world, persistent, shards,
                        os.path.join(directory, os.pardir, "data"))
    if blank_resume:
        from library_data import blank_resume_block

        block = blank_resume_block(built.dataset) if rank == 0 else None  # noqa: F841 (kept open to the end)
        fabric.barrier()  # every rank's load_state_dict finds it made, unwritten
    loader = fabric.setup_dataloaders(built)
    if ignore:
        loader.ignore_stream_position()
    state: Dict[str, Any] = {"loader": loader, "step": 0}
    checkpoint = os.path.join(directory, "checkpoint.pt")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if resume:
            try:
                fabric.load(resume, state)
            except Exception as error:  # the part-1 error, raised before the first batch
                return {"error": f"{type(error).__name__}: {error}"}
        step = resumed = int(state["step"])
        where = {"epoch": loader.epoch, "step": step}
        recorder = Recorder(directory, attempt, rank, lambda: (where["epoch"], where["step"]))
        epoch_batches: Dict[int, int] = {}
        stopped = False
        while loader.epoch < epochs and not stopped:
            where["epoch"] = loader.epoch
            epoch = loader.epoch
            for data in loader:
                step += 1
                where["step"] = step
                epoch_batches[epoch] = epoch_batches.get(epoch, 0) + 1
                for index in indices(data):
                    recorder.loaded(index)
                if step == save_at:
                    state["step"] = step
                    fabric.save(checkpoint, state)
                if step == stop_at:
                    stopped = True
                    break
    texts = [str(w.message) for w in caught if "stream" in str(w.message).lower() or "replay" in
             str(w.message).lower() or "resume" in str(w.message).lower()]
    if rank == 0:
        recorder.attempt_info(resumed, world, texts)
    del loader
    return {"resumed_step": resumed, "steps": step, "warnings": texts, "error": None, "epoch_batches": epoch_batches}
