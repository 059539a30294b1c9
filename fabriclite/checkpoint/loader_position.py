"""Where a loader stands inside an epoch, and how an epoch resumes from there.

A FabricDataLoader counts the batches it has yielded in the running epoch; its ``state_dict()`` is then
``{"epoch": e, "batch": k}``. Loading that state makes the next ``iter()`` start epoch ``e`` at batch ``k``:
``iterate_from`` skips the first ``k`` batches. A map-style dataset skips them in the sampler, without loading
a sample; an IterableDataset has no sampler, so its batches are produced and discarded (with a warning).

The state also records the world size (the number of shards the data is split into) and the batch size: a
position inside an epoch loaded at other sizes is a ValueError naming both (``read_position``); an epoch boundary
loads at any size.

Creating a DataLoader iterator draws a seed from torch's generator. A run that never stopped drew it at the
start of the epoch, before the checkpoint was written; so a resumed epoch creates its iterator without
touching the generator, and a resumed run draws the same random numbers from there on.
"""
from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any, Dict, Iterator, Mapping, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset


class SkipFirst:
    """The items of ``sampler`` (a sampler or batch sampler) after the first ``count``."""

    def __init__(self, sampler: Any, count: int) -> None:
        self.sampler = sampler
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), self.count, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.count)


def iterate_from(loader: DataLoader, skip: int) -> Iterator[Any]:
    """An iterator over ``loader``'s batches from batch ``skip`` on (see the module docstring)."""
    if skip <= 0:
        return iter(loader)
    if isinstance(loader.dataset, IterableDataset):
        warnings.warn(f"Resuming an IterableDataset mid-epoch: its first {skip} batches of this epoch are loaded "
                      "and discarded (it has no sampler to skip them in).", stacklevel=3)
        iterator = _quiet_iter(loader)
        for _ in range(skip):
            if next(iterator, _END) is _END:
                break
        return iterator
    resumed = copy.copy(loader)
    resumed._iterator = None  # type: ignore[attr-defined] # never share persistent workers with the original
    name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    object.__setattr__(resumed, name, SkipFirst(getattr(loader, name), skip))
    return _quiet_iter(resumed)


_END = object()


def _quiet_iter(loader: DataLoader) -> Iterator[Any]:
    """``iter(loader)`` without advancing torch's generator (the iterator's seed is drawn from a copy)."""
    state = torch.get_rng_state()
    try:
        return iter(loader)
    finally:
        torch.set_rng_state(state)


def position(epoch_next: int, consumed: Optional[int], pending: int, length: Optional[int],
             shape: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """A loader's ``state_dict``: ``epoch_next`` is the epoch the next ``iter()`` starts, ``consumed`` the
    batches yielded in the running epoch (None when none runs), ``pending`` the batches a loaded state still
    has to skip, ``length`` the batches per epoch (None if unknown). A finished epoch is the next one at 0.
    ``shape`` (``loader_shape``) is stored with it: a position inside an epoch means something only at that
    world size and batch size."""
    if consumed is None:
        where = {"epoch": epoch_next, "batch": pending}
    elif length is not None and consumed >= length:
        where = {"epoch": epoch_next, "batch": 0}
    else:
        where = {"epoch": epoch_next - 1, "batch": consumed}
    return {**where, **(shape or {})}


def loader_shape(loader: DataLoader) -> Dict[str, Optional[int]]:
    """``{"world_size", "batch_size"}`` of a (set-up) loader: the number of shards its DistributedSampler splits
    the data into (1 when it is not sharded) and its batch size (None for a custom batch sampler without one)."""
    samplers = [loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)]
    shards = next((s.num_replicas for s in samplers if isinstance(s, DistributedSampler)), 1)
    batch_size = loader.batch_size if loader.batch_size is not None else \
        getattr(loader.batch_sampler, "batch_size", None)
    return {"world_size": int(shards), "batch_size": batch_size}


def read_position(state: Mapping[str, Any], shape: Optional[Mapping[str, Any]] = None) -> Dict[str, int]:
    """``{"epoch", "batch"}`` from a saved loader state; an old ``{"epoch": n}`` is batch 0. ValueError for a
    negative or missing value, and for a position inside an epoch (batch > 0) saved at another world size or
    batch size than ``shape`` (this loader's): those batches are not the ones this run would skip. A state saved
    at an epoch boundary (batch 0), or without sizes (an older fabriclite), loads at any size."""
    if not isinstance(state, Mapping) or "epoch" not in state:
        raise ValueError(f"a loader state must be a dict with an 'epoch' (and optionally 'batch'); got {state!r}.")
    epoch, batch = int(state["epoch"]), int(state.get("batch", 0))
    if epoch < 0 or batch < 0:
        raise ValueError(f"loader state {dict(state)!r}: epoch and batch must be >= 0.")
    if batch > 0 and shape is not None:
        differ = [key for key in ("world_size", "batch_size")
                  if state.get(key) is not None and shape.get(key) is not None and state[key] != shape[key]]
        if differ:
            saved = ", ".join(f"{key} {state[key]}" for key in differ)
            now = ", ".join(f"{key} {shape[key]}" for key in differ)
            raise ValueError(f"The loader state stops at batch {batch} of epoch {epoch}, saved with {saved}; this "
                             f"loader has {now}. A position inside an epoch cannot be carried over to another world "
                             "size or batch size (the samples each rank has seen would be different ones). Resume "
                             f"with the saved sizes, or start epoch {epoch} over: leave the loader out of the "
                             f"loaded state and call loader.set_epoch({epoch}).")
    return {"epoch": epoch, "batch": batch}
