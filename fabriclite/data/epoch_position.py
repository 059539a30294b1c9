"""Where a loader stands inside an epoch, and how an epoch resumes from there, at the same world size or another.

A FabricDataLoader counts the batches it has yielded in the running epoch; its ``state_dict()`` is then
``{"epoch": e, "batch": k, ...}``. Loading that state makes the next ``iter()`` start epoch ``e`` at batch ``k``:
``iterate_from`` skips the first ``k`` batches. A map-style dataset skips them in the sampler, without loading
a sample; an IterableDataset has no sampler, so its batches are produced and discarded (with a warning).

The state also records the sizes the position holds for: the world size (the number of shards the data is split
into), the batch size per rank and the dataset's length; and, for a loader dealt by a plain ``DistributedSampler``
(what ``setup_dataloaders`` gives by default), the sampler's seed and shuffle and ``samples``: how many samples of
the epoch's order the whole job has consumed (``start + batch x batch_size x world_size``, ``start`` being where the
running dealing began: 0, except in an epoch resumed at another world size). See ``fabriclite.data.elastic_dealing``.

Loading a position inside an epoch:
- at the same world size: the same batches are skipped (bit-exact resume);
- at another world size: the rest of the epoch's order after ``samples`` is dealt over this run's ranks
  (``elastic_dealing.RestSampler``), with one warning (global batch size, padding); later epochs are plain ones;
- with another batch size per rank or dataset length: a ValueError naming both values;
- at another world size from a state without ``samples`` (an older fabriclite, or a sampler other than the plain
  ``DistributedSampler``): a ValueError, as before.
A state at an epoch boundary (batch 0) loads at any size.

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
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from fabriclite.data import elastic_dealing


class SkipFirst:
    """The items of ``sampler`` (a sampler or batch sampler) after the first ``count``."""

    def __init__(self, sampler: Any, count: int) -> None:
        self.sampler = sampler
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.sampler), self.count, None)

    def __len__(self) -> int:
        return max(0, len(self.sampler) - self.count)


def iterate_from(loader: DataLoader, skip: int, resumed: bool = False) -> Iterator[Any]:
    """An iterator over ``loader``'s batches from batch ``skip`` on (see the module docstring); ``resumed``: the
    epoch is a resumed one even at batch 0 (a dealing of an epoch's rest), so the generator is not drawn from."""
    if skip <= 0:
        return quiet_iter(loader) if resumed else iter(loader)
    if isinstance(loader.dataset, IterableDataset):
        warnings.warn(f"Resuming a stream (an IterableDataset without state_dict / load_state_dict) mid-epoch by "
                      f"replay: its first {skip} batches of this epoch are replayed (loaded again and discarded), a "
                      "wait that grows with the position. Give the dataset state_dict() and load_state_dict() to "
                      "resume it from its own state.", stacklevel=3)
        iterator = quiet_iter(loader)
        for _ in range(skip):
            if next(iterator, _END) is _END:
                break
        return iterator
    resumed = copy.copy(loader)
    resumed._iterator = None  # type: ignore[attr-defined] # never share persistent workers with the original
    name = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    object.__setattr__(resumed, name, SkipFirst(getattr(loader, name), skip))
    return quiet_iter(resumed)


_END = object()


def quiet_iter(loader: DataLoader) -> Iterator[Any]:
    """``iter(loader)`` without advancing torch's generator (the iterator's seed is drawn from a copy)."""
    state = torch.get_rng_state()
    try:
        return iter(loader)
    finally:
        torch.set_rng_state(state)




def dealer(loader: DataLoader) -> Optional[DistributedSampler]:
    """The plain ``DistributedSampler`` that deals ``loader``'s samples (with the default batch sampler, or none),
    or None: only such a loader's position can move to another world size."""
    sampler, batch_sampler = loader.sampler, loader.batch_sampler
    if type(sampler) is not DistributedSampler:
        return None
    if batch_sampler is not None and (type(batch_sampler) is not BatchSampler or batch_sampler.sampler is not sampler):
        return None
    return sampler


def loader_shape(loader: DataLoader) -> Dict[str, Any]:
    """What a position of ``loader`` (set up) holds for: ``world_size`` (the number of shards its DistributedSampler
    splits the data into; 1 when it is not sharded), ``batch_size`` (None for a custom batch sampler without one),
    ``dataset_length`` (when the dataset has a length) and, for a loader dealt by a plain DistributedSampler
    (:func:`dealer`), that sampler's ``seed`` and ``shuffle``."""
    samplers = [loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None)]
    shards = next((s.num_replicas for s in samplers if isinstance(s, DistributedSampler)), 1)
    batch_size = loader.batch_size if loader.batch_size is not None else \
        getattr(loader.batch_sampler, "batch_size", None)
    shape: Dict[str, Any] = {"world_size": int(shards), "batch_size": batch_size}
    if not isinstance(loader.dataset, IterableDataset):
        try:
            shape["dataset_length"] = len(loader.dataset)  # type: ignore[arg-type]
        except TypeError:
            pass
    sampler = dealer(loader)
    if sampler is not None:
        shape.update(seed=int(sampler.seed), shuffle=bool(sampler.shuffle))
    return shape


def position(epoch_next: int, consumed: Optional[int], pending: int, length: Optional[int],
             shape: Optional[Mapping[str, Any]] = None, dealing: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """A loader's ``state_dict``: ``epoch_next`` is the epoch the next ``iter()`` starts, ``consumed`` the
    batches yielded in the running epoch (None when none runs), ``pending`` the batches a loaded state still
    has to skip, ``length`` the batches of the running epoch (None if unknown). A finished epoch is the next one
    at 0. ``shape`` (:func:`loader_shape`) is stored with it. ``dealing`` (``{"start", "seed", "shuffle"}``, None
    for a plain epoch) is the running (or pending) epoch's dealing of its rest; with a shape that has a ``seed``,
    the state gets ``start`` and ``samples`` (see the module docstring)."""
    if consumed is None:
        where = {"epoch": epoch_next, "batch": pending}
    elif length is not None and consumed >= length:
        where, dealing = {"epoch": epoch_next, "batch": 0}, None
    else:
        where = {"epoch": epoch_next - 1, "batch": consumed}
    state: Dict[str, Any] = {**where, **(shape or {})}
    if "seed" in state:
        start = int(dealing["start"]) if dealing else 0
        if dealing:
            state.update(seed=int(dealing["seed"]), shuffle=bool(dealing["shuffle"]))
        state.update(start=start, samples=start + where["batch"] * _per_batch(state) * int(state["world_size"]))
    return state


def _per_batch(shape: Mapping[str, Any]) -> int:
    return int(shape.get("batch_size") or 1)  # batch_size=None: every sample is a batch


def _count(state: Mapping[str, Any], key: str, default: int = 0) -> int:
    value = int(state.get(key, default))
    if value < 0:
        raise ValueError(f"loader state {dict(state)!r}: {key} must be >= 0; got {value}.")
    return value


def read_position(state: Mapping[str, Any], shape: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Where a loader with ``shape`` (:func:`loader_shape`; None: no checks) resumes from a saved ``state``:
    ``{"epoch", "batch", "dealing", "from_world_size"}``. ``dealing`` (None for a plain epoch) is
    ``{"start", "seed", "shuffle"}``: the epoch's rest after ``start`` samples of its order, dealt over this loader's
    ranks; ``from_world_size`` is the saving world size when it differs from this loader's (an elastic resume),
    else None. An old ``{"epoch": n}`` is batch 0.

    ValueError, naming the values: a missing or negative value; a position inside an epoch saved with another batch
    size or dataset length; or saved at another world size by a state that cannot say which samples are consumed
    (no ``samples``: an older fabriclite or another sampler), or loaded into a loader not dealt by a plain
    DistributedSampler. A state at an epoch boundary loads at any size (see the module docstring)."""
    if not isinstance(state, Mapping) or "epoch" not in state:
        raise ValueError(f"a loader state must be a dict with an 'epoch' (and optionally 'batch'); got {state!r}.")
    try:
        epoch, batch, start = _count(state, "epoch"), _count(state, "batch"), _count(state, "start")
    except ValueError:
        raise ValueError(f"loader state {dict(state)!r}: epoch and batch must be >= 0.") from None
    plain = {"epoch": epoch, "batch": 0, "dealing": None, "from_world_size": None}
    if batch == 0 and start == 0:
        return plain
    where = f"The loader state stops at batch {batch} of epoch {epoch}" + (
        f" (of the epoch's rest after sample {start} of its order)" if start else "")
    fix = (f"Resume with the saved sizes, or start epoch {epoch} over: leave the loader out of the loaded state and "
           f"call loader.set_epoch({epoch}).")
    shape = shape or {}
    saved_length, length = state.get("dataset_length"), shape.get("dataset_length")
    if saved_length is not None and length is not None and saved_length != length:
        raise ValueError(f"{where}, saved for a dataset of {saved_length} samples; this loader's dataset has "
                         f"{length}. A position inside an epoch means nothing for another dataset. {fix}")
    saved_batch, batch_size = state.get("batch_size"), shape.get("batch_size")
    if saved_batch is not None and batch_size is not None and saved_batch != batch_size:
        raise ValueError(f"{where}, saved with batch_size {saved_batch}; this loader has batch_size {batch_size}. "
                         "A position inside an epoch cannot be carried over to another batch size per rank (the "
                         f"samples each rank has seen would be other ones). {fix}")
    saved_world, world = state.get("world_size"), shape.get("world_size")
    dealing = {"start": start, "seed": state.get("seed"), "shuffle": state.get("shuffle")} if start else None
    if saved_world is None or world is None or saved_world == world:
        if dealing is not None and ("seed" not in shape or dealing["seed"] is None):
            raise ValueError(f"{where}: the rest of that epoch is dealt by a plain DistributedSampler, but this "
                             f"loader's sampler is not one. {fix}")
        return {**plain, "batch": batch, "dealing": dealing}
    if "samples" not in state or state.get("seed") is None:
        raise ValueError(f"{where}, saved with world_size {saved_world}; this loader has world_size {world}. That "
                         "state cannot carry over to another world size: it does not record which samples of the "
                         "epoch were consumed (it was written by an older fabriclite, or by a loader whose sampler "
                         f"is not setup_dataloaders' plain DistributedSampler). {fix}")
    if "seed" not in shape:
        raise ValueError(f"{where}, saved with world_size {saved_world}; this loader has world_size {world}. Moving "
                         "a position to another world size needs the loader dealt by setup_dataloaders' plain "
                         "DistributedSampler (a sampler or batch sampler of your own cannot be re-dealt). " + fix)
    samples = _count(state, "samples")
    expected = start + batch * _per_batch(state) * int(saved_world)
    if samples != expected or saved_length is not None and samples >= saved_length:
        raise ValueError(f"loader state {dict(state)!r}: samples {samples} is not start + batch x batch_size x "
                         f"world_size = {expected} (below the dataset's length); the state is damaged.")
    return {"epoch": epoch, "batch": 0, "dealing": {"start": samples, "seed": int(state["seed"]),
                                                   "shuffle": bool(state["shuffle"])},
            "from_world_size": int(saved_world)}


def rest_loader(loader: DataLoader, epoch: int, dealing: Mapping[str, Any]) -> DataLoader:
    """A copy of ``loader`` (dealt by a plain DistributedSampler, :func:`dealer`) that iterates this rank's share of
    epoch ``epoch``'s rest after ``dealing["start"]`` samples (``elastic_dealing.RestSampler``), batched as ``loader``
    batches."""
    sampler = dealer(loader)
    if sampler is None:
        raise ValueError("only a loader dealt by a plain DistributedSampler can continue an epoch's rest.")
    rest = elastic_dealing.RestSampler(len(sampler.dataset), int(dealing["start"]),  # type: ignore[arg-type]
                                       sampler.num_replicas, sampler.rank, epoch, int(dealing["seed"]),
                                       bool(dealing["shuffle"]), sampler.drop_last)
    resumed = copy.copy(loader)
    resumed._iterator = None  # type: ignore[attr-defined] # never share persistent workers with the original
    object.__setattr__(resumed, "sampler", rest)
    if loader.batch_sampler is not None:
        object.__setattr__(resumed, "batch_sampler", BatchSampler(rest, loader.batch_sampler.batch_size,
                                                                  loader.batch_sampler.drop_last))
    return resumed


def elastic_note(loader: DataLoader, epoch: int, dealing: Mapping[str, Any], from_world_size: int) -> str:
    """What an elastic load of ``loader``'s position does, in a sentence or two, for the one warning: the samples
    consumed, how the rest is dealt (the repeats and the samples left out named), the global batch size before and
    after."""
    sampler = dealer(loader)
    assert sampler is not None
    length, start, world = len(sampler.dataset), int(dealing["start"]), sampler.num_replicas  # type: ignore
    dealt = elastic_dealing.deal_rest(length, start, world, epoch, int(dealing["seed"]), bool(dealing["shuffle"]),
                              sampler.drop_last)
    batch_sampler = loader.batch_sampler
    size = batch_sampler.batch_size if batch_sampler is not None else 1
    cut = batch_sampler is not None and batch_sampler.drop_last
    batches = len(dealt.shares[0]) // size if cut else -(-len(dealt.shares[0]) // size)
    dealt = dealt.batched(size, cut)
    left_out = dealt.left_out
    text = (f"the loader's position was saved by {from_world_size} ranks and this run has {world}: epoch {epoch} "
            f"continues after the first {start} of its {length} samples (in the epoch's order); the {length - start} "
            f"left are dealt over {world} ranks, {batches} batch{'' if batches == 1 else 'es'} each; {len(dealt.repeats)} repeated as padding"
            f"{f' {dealt.repeats}' if dealt.repeats else ''}")
    if left_out:
        text += f", {len(left_out)} left out by drop_last {left_out}"
    return (f"{text}. The batch size per rank is kept, so the global batch size changes from "
            f"{size * from_world_size} ({size} x {from_world_size} ranks) to {size * world} ({size} x {world} ranks).")
