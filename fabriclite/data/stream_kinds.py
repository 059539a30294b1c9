"""Where a stream (a loader over an ``IterableDataset``) stands inside an epoch, and whether that position can be
carried to this run's world size and number of workers.

A map-style dataset's position is a number of samples of the epoch's order (``epoch_position``, ``elastic_dealing``). A
stream has no order fabriclite can deal; its position is one of (``stream_kind``):

- ``"stateful"``: an ``IterableDataset`` with ``state_dict`` / ``load_state_dict`` (torch's ``Stateful`` protocol,
  a Hugging Face ``datasets.IterableDataset`` too): the dataset's own state, taken inside each DataLoader worker
  after each batch it produced, kept for the last batch the loop consumed from that worker
  (``fabriclite.data.worker_snapshots``). The dataset shards itself by rank and worker, so the state of worker
  ``w`` of rank ``r`` means something only to worker ``w`` of rank ``r``: same world size and number of workers only.
- ``"shards"``: a Hugging Face ``datasets.IterableDataset`` split with ``split_dataset_by_node`` and made of at least
  ranks x workers shards, no shuffle buffer: fabriclite deals its shards itself and records where each shard stands
  (``fabriclite.data.hf_shards``), so the rest of the epoch can be dealt again over any number of ranks and
  workers.
- ``"litdata"`` / ``"streaming"``: a litdata or MosaicML Streaming dataset, which keeps its own position and
  shards by rank and worker itself in an order that does not depend on the world size: its own state is saved and
  handed back (``fabriclite.data.library_streams``), at any world size and number of workers.
- ``"stateless"``: any other stream (a Hugging Face stream with a shuffle buffer too: its own state loses the
  buffer's contents). At the same sizes its first batches are produced again and discarded (replay,
  with a warning naming how many); at other sizes its position means nothing.

Every position records the sizes it holds for (``world_size``, ``num_workers``). Loading a position inside an epoch
that cannot be carried to this run's sizes raises :class:`StreamPositionError` before the first batch, naming both
sizes, the position, the fix and the opt-out (``loader.ignore_stream_position()``: for a stream whose position does
not matter, such as an endless random stream, the epoch counter is kept and the stream starts over).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from torch.utils.data import DataLoader, IterableDataset

from fabriclite.data import library_streams

#: the datasets versions whose private ``IterableDataset._distributed`` (``split_dataset_by_node``'s record) and shard
#: layout fabriclite's shard dealing reads; another version's streams are resumed as ``"stateful"`` ones
DATASETS_VERSIONS = ("5.2.",)


class StreamPositionError(ValueError):
    """A stream's position inside an epoch cannot be carried to this run's world size or number of workers."""


def is_hf_iterable(dataset: Any) -> bool:
    """Whether ``dataset`` is a Hugging Face ``datasets.IterableDataset`` (datasets is not imported)."""
    return any(cls.__name__ == "IterableDataset" and cls.__module__.startswith("datasets.")
               for cls in type(dataset).__mro__)


def is_stateful_dataset(dataset: Any) -> bool:
    """Whether ``dataset`` has ``state_dict`` and ``load_state_dict`` (torch's ``Stateful`` protocol)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def is_torchdata_loader(loader: Any) -> bool:
    """Whether ``loader`` is a torchdata ``StatefulDataLoader`` (torchdata is not imported)."""
    return any(cls.__name__ == "StatefulDataLoader" and cls.__module__.startswith("torchdata")
               for cls in type(loader).__mro__)


def shards_refusal(dataset: Any, world_size: int, num_workers: int) -> Optional[str]:
    """Why fabriclite cannot deal the shards of the Hugging Face ``dataset`` over ``world_size`` ranks x
    ``num_workers`` workers (None: it can): not split with ``split_dataset_by_node`` for this world size (a user's own
    sharding), an unsupported datasets version, a shuffle buffer, fewer shards than ranks x workers."""
    import datasets

    distributed = getattr(dataset, "_distributed", None)
    if distributed is None:
        return ("it is not split with datasets.distributed.split_dataset_by_node (a sharding of your own, or none, "
                "cannot be dealt again)")
    if not datasets.__version__.startswith(DATASETS_VERSIONS):
        return (f"fabriclite deals the shards of datasets {' / '.join(v + 'x' for v in DATASETS_VERSIONS)} only "
                f"(it reads split_dataset_by_node's private record); this is datasets {datasets.__version__}")
    if int(distributed.world_size) != world_size:
        return (f"it was split with split_dataset_by_node(..., world_size={distributed.world_size}) but the job has "
                f"{world_size} ranks")
    if has_shuffle_buffer(dataset):
        return ("it has a shuffle buffer (.shuffle()), whose contents a saved position loses (Hugging Face documents "
                "this)")
    shards = int(dataset._ex_iterable.num_shards)
    slots = world_size * max(1, num_workers)
    if shards < slots:
        return (f"it has {shards} shards, fewer than ranks x workers = {world_size} x {max(1, num_workers)} = {slots}; "
                "reshard it (more files, or Dataset.to_iterable_dataset(num_shards=...))")
    return None


def has_shuffle_buffer(dataset: Any) -> bool:
    """Whether the Hugging Face ``dataset`` shuffles through a buffer (``.shuffle()``)."""
    return any("BufferShuffled" in type(part).__name__ for part in _pipeline(dataset._ex_iterable))


def _pipeline(ex_iterable: Any) -> Any:
    """Every examples iterable of a Hugging Face pipeline (its ``ex_iterable`` / ``ex_iterables`` chain)."""
    yield ex_iterable
    for inner in [getattr(ex_iterable, "ex_iterable", None), *getattr(ex_iterable, "ex_iterables", [])]:
        if inner is not None:
            yield from _pipeline(inner)


def stream_kind(loader: DataLoader, world_size: int) -> Optional[str]:
    """``"shards"``, ``"stateful"`` or ``"stateless"`` for a loader over an ``IterableDataset`` (see the module
    docstring); None for a map-style dataset."""
    dataset = loader.dataset
    if not isinstance(dataset, IterableDataset):
        return None
    library = library_streams.library_of(loader)
    if library is not None:
        return library
    if is_hf_iterable(dataset):
        if shards_refusal(dataset, world_size, loader.num_workers) is None:
            return "shards"
        if has_shuffle_buffer(dataset):
            return "stateless"  # its state loses the buffer's contents (Hugging Face documents this): replayed
    return "stateful" if is_stateful_dataset(dataset) else "stateless"


def describe(kind: str) -> str:
    """The loader kind in words, for messages."""
    if kind in library_streams.LIBRARIES:
        return library_streams.describe(kind)
    return {"shards": "Hugging Face IterableDataset dealt by shards",
            "stateful": "IterableDataset with its own state_dict (sharded by rank and worker by the dataset itself)",
            "stateless": "IterableDataset without state_dict / load_state_dict"}.get(kind, kind)


def sizes(world_size: int, num_workers: int) -> str:
    """Sizes in words, for messages: ``2 ranks x 2 workers``."""
    return f"{world_size} rank{'' if world_size == 1 else 's'} x {num_workers} worker{'' if num_workers == 1 else 's'}"


def refuse(state: Mapping[str, Any], world_size: int, num_workers: int, why: str) -> StreamPositionError:
    """The error for a stream position ``state`` (saved at ``state["world_size"]`` x ``state["num_workers"]``) that
    cannot be loaded at ``world_size`` x ``num_workers``: both sizes, the position, ``why``, the fix, the opt-out."""
    epoch, batch = int(state["epoch"]), int(state["batch"])
    saved = sizes(int(state["world_size"]), int(state.get("num_workers", 0)))
    return StreamPositionError(
        f"The loader's position, batch {batch} of epoch {epoch} ({batch} batches consumed per rank, "
        f"{describe(str(state.get('stream')))}), was saved by {saved}; this run has {sizes(world_size, num_workers)}. "
        f"It cannot be carried over: {why}. Resuming anyway would skip or repeat samples. Fix: resume with {saved} "
        f"(num_workers={int(state.get('num_workers', 0))}); or start epoch {epoch} over: leave the loader out of the "
        f"loaded state and call loader.set_epoch({epoch}); or, if this stream's position does not matter (an endless "
        f"random stream, say), call loader.ignore_stream_position() before loading: the epoch counter is kept and "
        "the stream starts over.")


def plan(state: Mapping[str, Any], kind: Optional[str], world_size: int, num_workers: int,
         ignore: bool = False, refusal: Optional[str] = None) -> str:
    """How a stream position ``state`` (inside an epoch, written by this fabriclite: it has ``"stream"``) resumes in a
    loader of ``kind`` at ``world_size`` x ``num_workers``: ``"restart"`` (the opt-out: the epoch's stream starts
    over), ``"states"`` (each worker loads its own state), ``"replay"`` (the first batches are produced again),
    ``"deal"`` (the shards' rest is dealt over this run's ranks and workers), ``"library"`` (litdata or Streaming
    loads its own state). StreamPositionError when it cannot;
    ``refusal``: why this run cannot deal a Hugging Face stream's shards (``shards_refusal``), for the message."""
    if ignore:
        return "restart"
    saved_kind = state["stream"]
    same = int(state["world_size"]) == world_size and int(state.get("num_workers", 0)) == num_workers
    if kind != saved_kind:
        raise refuse(state, world_size, num_workers,
                     f"it was saved for a {describe(saved_kind)} and this loader's dataset is "
                     + (f"a {describe(kind)}" if kind else "map-style")
                     + (f"; fabriclite cannot deal its shards here: {refusal}" if refusal else ""))
    if kind == "shards":
        return "states" if same else "deal"
    if kind in library_streams.LIBRARIES:
        return "library"  # the library resumes its own position, at any world size and number of workers
    if same:
        return "states" if kind == "stateful" else "replay"
    moved = "world size" if int(state["world_size"]) != world_size else "number of workers"
    why = {"stateful": f"each rank's and worker's state belongs to the shard of the stream the dataset gave that rank "
                       f"and worker, and at another {moved} the dataset shards the stream another way",
           "stateless": f"the dataset has no state, and at another {moved} it shards the stream another way, so "
                        "replaying its first batches would not give back the samples consumed"}[kind]
    if state.get("hf_refusal"):
        why += f"; fabriclite cannot deal its shards again: {state['hf_refusal']}"
    raise refuse(state, world_size, num_workers, why)


__all__ = ["DATASETS_VERSIONS", "StreamPositionError", "describe", "is_hf_iterable", "is_stateful_dataset",
           "has_shuffle_buffer", "is_torchdata_loader", "plan", "refuse", "shards_refusal", "sizes", "stream_kind"]
