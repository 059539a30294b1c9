"""Distributed sampling: a loader's samples dealt over the ranks (``shard``: the sampler or batch sampler replaced on
the loader ``training.module_setup.setup_dataloader`` prepares), and ``gather_eval`` (every rank's per-sample results
over an eval set, the sampler's padding duplicates removed).

Sampling: a loader whose sampler is a plain ``RandomSampler`` / ``SequentialSampler`` gets a
``DistributedSampler`` over its dataset (shuffle kept, seed from ``seed_everything``, ``drop_last=False``
so that every sample is seen: ranks with fewer samples repeat the first ones as padding). Any other
sampler is sharded by ``DistributedSamplerWrapper``; a custom batch sampler is sharded batch by batch.
The loader's own ``batch_size`` / ``drop_last`` / workers / collate function are kept.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sized, Union

from torch import Tensor
from torch.utils.data import (BatchSampler, DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler,
                              SequentialSampler)

if TYPE_CHECKING:
    from fabriclite.collectives.state import Strategy


class _SamplerAsDataset(Dataset):
    """The indices a sampler yields, as a dataset (re-drawn at every ``reset``)."""

    def __init__(self, sampler: Union[Sampler, Sized]) -> None:
        if not isinstance(sampler, Sized):
            raise TypeError(f"The loader's sampler {type(sampler).__name__} has no __len__, so it cannot be sharded "
                            "across ranks. Give it a __len__, or pass use_distributed_sampler=False and shard it "
                            "yourself.")
        self.sampler = sampler
        self._indices: Optional[List[Any]] = None

    def reset(self) -> None:
        self._indices = list(self.sampler)  # type: ignore[call-overload]

    def __getitem__(self, index: int) -> Any:
        if self._indices is None:
            self.reset()
        assert self._indices is not None
        return self._indices[index]

    def __len__(self) -> int:
        return len(self.sampler)


class DistributedSamplerWrapper(DistributedSampler):
    """Shards any sized sampler (or batch sampler) across ranks: each epoch draws the full sequence from
    ``sampler`` and yields this rank's share (every ``num_replicas``-th item, padded like
    ``DistributedSampler``). Shuffling is the wrapped sampler's business; ``set_epoch`` is passed on to it.
    """

    def __init__(self, sampler: Union[Sampler, Sized], num_replicas: int, rank: int, **kwargs: Any) -> None:
        kwargs.setdefault("shuffle", False)
        super().__init__(_SamplerAsDataset(sampler), num_replicas=num_replicas, rank=rank, **kwargs)

    @property
    def sampler(self) -> Any:
        return self.dataset.sampler  # type: ignore[attr-defined]

    def __iter__(self) -> Iterator[Any]:
        self.dataset.reset()  # type: ignore[attr-defined]
        return (self.dataset[index] for index in super().__iter__())

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)


def shard(loader: DataLoader, kwargs: Dict[str, Any], seed: int) -> None:
    """Deal ``loader``'s samples over the ranks in place (a copy of the user's loader): its sampler replaced by
    :func:`distributed_sampler`'s (``kwargs``: the strategy's ``distributed_sampler_kwargs``; ``seed``: the global
    seed), or a custom batch sampler by a ``DistributedSamplerWrapper`` around it; one dealt already is kept."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and not _plain(batch_sampler, BatchSampler):
        if isinstance(batch_sampler, DistributedSamplerWrapper):
            return
        _set(loader, "batch_sampler", DistributedSamplerWrapper(batch_sampler, **kwargs))
        return
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        return
    new = distributed_sampler(loader.dataset, sampler, kwargs, seed)
    _set(loader, "sampler", new)
    if batch_sampler is not None:
        _set(loader, "batch_sampler", BatchSampler(new, batch_sampler.batch_size, batch_sampler.drop_last))


def distributed_sampler(dataset: Any, sampler: Any, kwargs: Dict[str, Any], seed: int) -> DistributedSampler:
    """The sampler that replaces ``sampler``: a DistributedSampler for plain random / sequential sampling
    (shuffle kept, seeded with ``seed``, the global seed), a DistributedSamplerWrapper for anything else."""
    plain_random = _plain(sampler, RandomSampler) and not sampler.replacement and \
        sampler.num_samples == len(sampler.data_source)
    if plain_random or _plain(sampler, SequentialSampler):
        return DistributedSampler(dataset, shuffle=plain_random, seed=seed, drop_last=False, **kwargs)
    return DistributedSamplerWrapper(sampler, **kwargs)


def _plain(obj: Any, cls: type) -> bool:
    """Whether ``obj`` is torch's plain ``cls`` or torchdata's StatefulDataLoader stand-in for it (same name, from
    ``torchdata.stateful_dataloader``: a StatefulDataLoader made with ``shuffle`` / ``batch_size`` has those)."""
    kind = type(obj)
    torchdata = kind.__module__.startswith("torchdata.stateful_dataloader")
    return kind is cls or (kind.__name__ == cls.__name__ and torchdata)


def gather_eval(strategy: Strategy, data: Any, loader: Any) -> Any:
    """Every rank's per-sample results over one pass of ``loader`` (the DataLoader under the FabricDataLoader
    ``setup_dataloaders`` returned: ``fabric.gather_eval`` unwraps it), on every rank, in the sampler's
    order, each sample exactly once: the first dimension of every tensor leaf becomes ``len(sampler)``
    (``len(dataset)`` for the default samplers), the padding duplicates of the distributed sampler dropped.

    ``data``: a tensor or nested collection (dict / list / tuple) of tensors whose first dimension runs over
    the samples this rank saw, in order (e.g. the concatenated per-batch predictions). Raises ValueError
    when the loader's sampling cannot be undone (batch-level ``drop_last``, a sharded batch sampler, no
    distributed sampler with several ranks) or a leaf's length is not this rank's sample count.
    """
    from fabriclite import collectives

    world = strategy.world_size
    sampler = getattr(loader, "sampler", None)
    if world == 1:  # nothing to gather, no padding
        return data
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last or sampler.num_replicas != world:
        raise ValueError("gather_eval() needs the loader returned by setup_dataloaders() (with the default "
                         f"use_distributed_sampler=True); its sampler is {type(sampler).__name__}.")
    if type(loader.batch_sampler) not in (BatchSampler, type(None)) or getattr(loader, "drop_last", False):
        raise ValueError("gather_eval() cannot recover every sample from a loader with drop_last=True or a custom "
                         "batch sampler; evaluate with drop_last=False and the default batch sampler.")
    per_rank, total = sampler.num_samples, len(sampler.dataset)  # type: ignore[arg-type]

    def check(t: Tensor) -> Tensor:
        if not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] != per_rank:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"gather_eval(): every leaf must be a tensor with this rank's {per_rank} samples "
                             f"along dim 0 (ceil({total}/{world})); got {shape}. Concatenate the results of one "
                             "full pass over the loader.")
        return t

    _map_tensors(data, check, strict=True)
    gathered = collectives.all_gather(strategy, data)

    def interleave(t: Tensor) -> Tensor:  # (world, per_rank, ...) -> (per_rank * world, ...)[:total]
        return t.transpose(0, 1).reshape(per_rank * world, *t.shape[2:])[:total]

    return _map_tensors(gathered, interleave)


def _map_tensors(data: Any, fn: Any, strict: bool = False) -> Any:
    if isinstance(data, Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)((k, _map_tensors(v, fn, strict)) for k, v in data.items())
    if isinstance(data, (list, tuple)):
        items = [_map_tensors(v, fn, strict) for v in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)
    if strict:
        return fn(data)
    return data


def _set(loader: DataLoader, name: str, value: Any) -> None:
    """Set a DataLoader attribute that DataLoader forbids changing after construction (on our copy)."""
    object.__setattr__(loader, name, value)

