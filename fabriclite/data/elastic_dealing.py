"""Elastic dealing: what a loader position written by W ranks means to a run of W' != W ranks.

**The data.** ``DistributedSampler`` deals an epoch's order out interleaved: it pads (or, with ``drop_last``, cuts)
the order to a multiple of the number of ranks, and rank ``r`` takes the positions ``r, r + W, r + 2W, ...``. So
after ``k`` steps of ``B`` samples per rank, the samples the W ranks have consumed together are exactly the order's
first ``k x B x W`` positions, whatever the rank. A checkpoint inside an epoch (before its last batch) never
reaches the padding: the padding is the last ``< W`` positions, and they belong to the epoch's last batch. So
"consumed" is always a prefix of the epoch's order, of real, distinct samples; :func:`epoch_order` is that order
(``DistributedSampler``'s: ``randperm(N)`` from ``seed + epoch``, or ``range(N)``).

A run at W' continues the epoch with the rest of the order, ``order[start:]``, dealt over its W' ranks the way
``DistributedSampler`` deals a dataset of that length (:func:`deal`): padded with the rest's first samples to a
multiple of W' (at most W' - 1 repeats), or cut to one with ``drop_last``; interleaved. Every rank gets the same
number of samples, so the same number of batches. :func:`deal_rest` is the whole plan (every rank's share, the
repeats, the samples left out), :class:`RestSampler` one rank's share as a sampler. Later epochs are plain
``DistributedSampler`` epochs at W'.

**The random states** of a run at W' are ``checkpoint.resume_state``'s (a new rank's seed: its ``new_rank_seed``).

**One warning.** Everything a load changes because the world size changed (the loader's dealing and global batch
size, the random states) is said in one warning line on global rank 0: parts call :func:`note` (the loader here,
``checkpoint.resume_state`` for the random states), and ``fabric.load`` collects them with :func:`one_warning`.
Outside it, a note is a warning of its own.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Sequence

import torch
from torch.utils.data import Sampler


def epoch_order(length: int, epoch: int, seed: int, shuffle: bool) -> List[int]:
    """The order ``DistributedSampler(shuffle=shuffle, seed=seed)`` deals epoch ``epoch`` of a dataset of
    ``length`` samples from (before its padding)."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        return torch.randperm(length, generator=generator).tolist()
    return list(range(length))


def share_size(length: int, world_size: int, drop_last: bool) -> int:
    """How many samples each of ``world_size`` ranks gets when ``length`` samples are dealt as
    ``DistributedSampler`` deals them (``num_samples``)."""
    if drop_last and length % world_size != 0:
        return math.ceil((length - world_size) / world_size)
    return math.ceil(length / world_size)


@dataclass
class Dealt:
    """One dealing: ``shares[r]`` is rank r's samples in order; ``repeats`` the samples dealt a second time as
    padding (at most ``world_size - 1``); ``left_out`` those ``drop_last`` cut."""

    shares: List[List[int]]
    repeats: List[int] = field(default_factory=list)
    left_out: List[int] = field(default_factory=list)

    def batched(self, batch_size: int, drop_last: bool) -> "Dealt":
        """The dealing as a ``BatchSampler(batch_size, drop_last)`` yields it on every rank: with ``drop_last`` each
        share cut to whole batches; ``repeats`` (sorted) the samples yielded more than once, counted with
        multiplicity, and ``left_out`` (sorted) the dealt samples never yielded."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1; got {batch_size}.")
        shares = [share[:len(share) // batch_size * batch_size] if drop_last else list(share) for share in self.shares]
        counts = Counter(i for share in shares for i in share)
        dealt = set(i for share in self.shares for i in share) | set(self.left_out)
        return Dealt(shares, sorted(i for i, c in counts.items() for _ in range(c - 1)),
                     sorted(dealt - set(counts)))


def deal(order: Sequence[int], world_size: int, drop_last: bool = False) -> Dealt:
    """``order`` dealt over ``world_size`` ranks exactly as ``DistributedSampler`` deals a dataset whose order it
    is: padded with its first items to a multiple of ``world_size`` (or cut to one with ``drop_last``), then rank
    r takes positions r, r + world_size, ..."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}.")
    items = list(order)
    total = share_size(len(items), world_size, drop_last) * world_size
    repeats: List[int] = []
    left_out: List[int] = []
    if total >= len(items):
        pad = total - len(items)
        if items and pad:
            repeats = (items * math.ceil(pad / len(items)))[:pad]
        items = items + repeats
    else:
        left_out = items[total:]
        items = items[:total]
    return Dealt([items[rank:total:world_size] for rank in range(world_size)], repeats, left_out)


def deal_rest(length: int, start: int, world_size: int, epoch: int, seed: int, shuffle: bool,
              drop_last: bool = False) -> Dealt:
    """The rest of epoch ``epoch``, after its order's first ``start`` samples were consumed, dealt over
    ``world_size`` ranks (see the module docstring). ``start = 0`` is the plain ``DistributedSampler`` epoch."""
    if not 0 <= start <= length:
        raise ValueError(f"start must be within the dataset's {length} samples; got {start}.")
    return deal(epoch_order(length, epoch, seed, shuffle)[start:], world_size, drop_last)


class RestSampler(Sampler[int]):
    """Rank ``rank``'s share of :func:`deal_rest` (the same arguments), as a sampler: what a resumed run at
    another world size iterates for the rest of the saved epoch."""

    def __init__(self, length: int, start: int, num_replicas: int, rank: int, epoch: int, seed: int, shuffle: bool,
                 drop_last: bool = False) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not one of {num_replicas} ranks.")
        if not 0 <= start <= length:
            raise ValueError(f"start must be within the dataset's {length} samples; got {start}.")
        self.length, self.start, self.num_replicas, self.rank = length, start, num_replicas, rank
        self.epoch, self.seed, self.shuffle, self.drop_last = epoch, seed, shuffle, drop_last

    def __iter__(self) -> Iterator[int]:
        dealt = deal_rest(self.length, self.start, self.num_replicas, self.epoch, self.seed, self.shuffle,
                          self.drop_last)
        return iter(dealt.shares[self.rank])

    def __len__(self) -> int:
        return share_size(self.length - self.start, self.num_replicas, self.drop_last)


# ---------------------------------------------------------------------- the one warning
_collected: Optional[List[str]] = None


def note(text: str, warn: bool) -> None:
    """Say ``text`` (one sentence or a few) about an elastic load: collected into the one warning when inside
    :func:`one_warning`, else warned now when ``warn`` (global rank 0)."""
    if _collected is not None:
        if text not in _collected:
            _collected.append(text)
    elif warn:
        warnings.warn(f"Elastic resume: {text}", stacklevel=3)


@contextlib.contextmanager
def one_warning(warn: bool) -> Iterator[None]:
    """Collect the :func:`note` calls of a load and warn them as one line at the end (when ``warn``)."""
    global _collected
    outer = _collected
    if outer is None:
        _collected = []
    try:
        yield
    finally:
        collected, _collected = _collected, outer
        if outer is None and collected and warn:
            sentences = collected[:1] + [text[:1].upper() + text[1:] for text in collected[1:]]
            warnings.warn("Elastic resume: " + " ".join(sentences), stacklevel=3)


__all__ = ["Dealt", "RestSampler", "deal", "deal_rest", "epoch_order", "note", "one_warning", "share_size"]
