"""Taking a stream's state inside each DataLoader worker, for the batches the training loop consumed.

A DataLoader's workers run ahead of the loop (``prefetch_factor`` batches each), and each holds its own copy of the
dataset: the copy in the main process never advances. So the state of a stream is taken where the stream runs, and
travels with the batch it belongs to:

- :class:`SnapshotStream` wraps a *source* (:class:`DatasetSource`: a dataset with ``state_dict`` /
  ``load_state_dict``; or ``hf_shards.ShardDealer``). In each worker (or in the main process with
  ``num_workers=0``) it tags the last item of every batch with the source's snapshot taken right after that item:
  ``{"worker": w, "state": ..., "batches": n, "end": bool}``; :class:`TaggedCollate` collates the items and keeps
  the tag, so each batch arrives as ``(batch, tag)``.
- The main process (``FabricDataLoader``) hands the loop the batch and keeps the tag of the last batch it handed
  out, per worker (:class:`Consumed`). A batch a worker prefetched and the loop never got leaves no trace.
- On resume, :func:`resumed_copy` gives a copy of the loader (its own workers: persistent workers of the original are
  never reused) whose dataset loads, in each worker, that worker's state before its first item. Later epochs run on
  the original loader, whose workers never loaded a state: a state is applied once (datasets #7447).
- A state taken after a worker's stream ended says so (``"end"``), and a position at an epoch's end is the next epoch
  at batch 0 without any state (torchdata #1437).
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional

from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate, default_convert

_END = object()
#: what a worker resumes from when its stream had ended: nothing (its dataset's state at the end is not trusted)
ENDED = "fabriclite: stream ended"


class Tagged(NamedTuple):
    """An item (or a collated batch) and the snapshot that goes with it (None inside a batch)."""

    data: Any
    tag: Optional[Dict[str, Any]]


class DatasetSource:
    """A dataset with ``state_dict`` / ``load_state_dict`` as a source of :class:`SnapshotStream`."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def stream(self, worker: int, workers: int, resume: Optional[Any]) -> "DatasetStream":
        dataset = self.dataset
        if resume is not None:
            if get_worker_info() is None:
                dataset = copy.deepcopy(dataset)  # the main process's dataset never keeps a loaded state
            dataset.load_state_dict(copy.deepcopy(resume))
        return DatasetStream(dataset)


class DatasetStream:
    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)

    def snapshot(self) -> Any:
        return copy.deepcopy(self.dataset.state_dict())


class SnapshotStream(IterableDataset):
    """The items of ``source``'s stream, the last item of every batch of ``per_batch`` items (and the stream's last
    item) tagged with the snapshot taken right after it; ``resume``: worker -> the state that worker starts from
    (applied once: the next ``iter()`` in the same worker starts fresh)."""

    def __init__(self, source: Any, per_batch: int, resume: Optional[Dict[int, Any]] = None) -> None:
        self.source, self.per_batch, self.resume = source, max(1, int(per_batch)), resume

    def __iter__(self) -> Iterator[Tagged]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        resume, self.resume = (self.resume or {}).get(worker), None
        if isinstance(resume, str) and resume == ENDED:
            return
        stream = self.source.stream(worker, workers, resume)
        iterator = iter(stream)
        item, count = next(iterator, _END), 0
        while item is not _END:
            count += 1
            tag = None
            if count % self.per_batch == 0:
                tag = {"worker": worker, "state": stream.snapshot(), "batches": count // self.per_batch, "end": False}
            following = next(iterator, _END)
            if following is _END:
                if tag is None:
                    tag = {"worker": worker, "state": stream.snapshot(), "batches": -(-count // self.per_batch)}
                tag["end"] = True
            yield Tagged(item, tag)
            item = following


class TaggedCollate:
    """``collate`` over the items of :class:`Tagged` items, keeping the last item's tag: ``Tagged(batch, tag)``."""

    def __init__(self, collate: Optional[Callable[[Any], Any]], batched: bool) -> None:
        self.collate = collate if collate is not None else (default_collate if batched else default_convert)
        self.batched = batched

    def __call__(self, items: Any) -> Tagged:
        if self.batched:
            return Tagged(self.collate([item.data for item in items]), items[-1].tag)
        return Tagged(self.collate(items.data), items.tag)


def snapshot_loader(loader: DataLoader, source: Any, resume: Optional[Dict[int, Any]] = None) -> DataLoader:
    """A copy of ``loader`` (workers of its own) whose batches arrive as ``Tagged(batch, tag)``: its dataset a
    :class:`SnapshotStream` over ``source``, its collate function a :class:`TaggedCollate` around ``loader``'s."""
    batched = loader.batch_size is not None
    tagged = copy.copy(loader)
    tagged._iterator = None  # type: ignore[attr-defined] # never share persistent workers with the original
    object.__setattr__(tagged, "dataset", SnapshotStream(source, loader.batch_size if batched else 1, resume))
    object.__setattr__(tagged, "collate_fn", TaggedCollate(loader.collate_fn, batched))
    return tagged


def resumed_copy(tagged: DataLoader, resume: Dict[int, Any], first_worker: int = 0) -> DataLoader:
    """A copy of the tagged loader ``tagged`` (:func:`snapshot_loader`) whose workers start from ``resume`` (worker ->
    state); its workers are its own, so the original's persistent workers never see the state. Its first batch is
    asked of worker ``first_worker`` (the one an uninterrupted run would have asked next: the batches come in the
    same order as they would have)."""
    stream = tagged.dataset
    assert isinstance(stream, SnapshotStream)
    resumed = copy.copy(tagged)
    resumed._iterator = None  # type: ignore[attr-defined]
    object.__setattr__(resumed, "dataset", SnapshotStream(stream.source, stream.per_batch, dict(resume)))
    if first_worker % max(1, tagged.num_workers):
        object.__setattr__(resumed, "_get_iterator", lambda: _rotated_iterator(resumed, first_worker))
    return resumed


def _rotated_iterator(loader: DataLoader, first_worker: int) -> Any:
    """torch's multi-worker iterator over ``loader``, its round robin over the workers starting at ``first_worker``
    (torch starts every epoch at worker 0: it keeps the cycle in ``_worker_queue_idx_cycle``, set in ``_reset`` before
    the first indices are sent)."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    class Rotated(_MultiProcessingDataLoaderIter):
        @property  # type: ignore[override]
        def _worker_queue_idx_cycle(self) -> Any:
            return self.__dict__["_fabriclite_cycle"]

        @_worker_queue_idx_cycle.setter
        def _worker_queue_idx_cycle(self, cycle: Any) -> None:
            for _ in range(self.__dict__.pop("_fabriclite_rotate", 0)):
                next(cycle)
            self.__dict__["_fabriclite_cycle"] = cycle

    iterator = Rotated.__new__(Rotated)
    iterator.__dict__["_fabriclite_rotate"] = first_worker
    iterator.__init__(loader)  # type: ignore[misc]
    return iterator


class Consumed:
    """The tags of the last batch handed to the loop, per worker, in the running epoch."""

    def __init__(self, start: Optional[Dict[int, Any]] = None) -> None:
        #: worker -> the last consumed batch's tag (a resumed epoch starts from the states it loaded)
        self.tags: Dict[int, Dict[str, Any]] = {int(w): dict(t) for w, t in (start or {}).items()}
        self.last_worker: Optional[int] = None

    def hand_out(self, tag: Optional[Dict[str, Any]]) -> None:
        if tag is not None:
            self.tags[int(tag["worker"])] = tag
            self.last_worker = int(tag["worker"])

    def state(self) -> Dict[str, Any]:
        """``{"workers": {w: tag}, "last_worker": w}``: what a rank records of its workers."""
        return {"workers": {w: dict(t) for w, t in sorted(self.tags.items())}, "last_worker": self.last_worker}


def next_worker(rank_state: Optional[Dict[str, Any]], num_workers: int) -> int:
    """The worker an uninterrupted run would have asked for the next batch, after a rank's recorded state."""
    last = (rank_state or {}).get("last_worker")
    return 0 if last is None or num_workers < 2 else (int(last) + 1) % num_workers


def worker_states(rank_state: Optional[Dict[str, Any]]) -> Dict[int, Any]:
    """worker -> the state it resumes from, out of a rank's recorded :meth:`Consumed.state`."""
    if not rank_state:
        return {}
    return {int(w): ENDED if tag.get("end") else tag["state"] for w, tag in rank_state.get("workers", {}).items()}


def all_ended(rank_states: List[Optional[Dict[str, Any]]], num_workers: int) -> bool:
    """Whether every worker of every rank had handed out its stream's last batch."""
    for rank_state in rank_states:
        workers = (rank_state or {}).get("workers", {})
        if len(workers) < max(1, num_workers) or not all(tag.get("end") for tag in workers.values()):
            return False
    return True


__all__ = ["Consumed", "DatasetSource", "SnapshotStream", "Tagged", "TaggedCollate", "all_ended", "resumed_copy",
           "next_worker", "snapshot_loader", "worker_states"]
