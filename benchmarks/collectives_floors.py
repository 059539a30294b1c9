"""The floors of benchmarks/collectives.py: hand-written paths, one per case, that do the least Python a
collection-aware collective must do for that case and nothing more.

- Floor (a): read the leaves' values into one flat buffer, run one torch.distributed collective, hand the
  results back in the same structure and types (a dict of tensors; the input is not modified). No
  agreement check: a rank with other keys, dtypes or shapes gets garbage or a hang.
- Floor (b): (a) with the least agreement check: a tag cached per (keys, dtypes, shapes), read per call,
  travels with the data in the same collective and is compared on every rank. Rows of at most 8 KiB ride
  whole in that collective (the data reduced from every rank's row on every rank); a one-leaf float32
  row rides in one int64 word per rank through an all_reduce sum (each rank's word at its index), gloo's
  cheapest collective; larger data sends the tag that way first, then runs (a). gloo (CPU tensors) only.

Both floors reuse their result buffers as fabriclite does, where that is legal: a buffer is handed out
again only when nothing outside can see it any more (no Python reference to a result made from it, no
other tensor sharing its memory, no in-place change since), up to ``DEPTH`` buffers per case; from
``POOLED`` 0-d leaves on (fewer are cheaper made fresh). Wire buffers that are never handed out (inputs
of an all_gather, gathered rows) are kept for good. A large tensor is reduced in four chunks, each
copied while the ones before it are reduced. So whether the caller drops its results at once or keeps
them, a floor does no more work than a careful hand-writer would, and stays a floor.

The cases are those of the benchmark: a dict of ``n`` 0-d float32 tensors, or of one large float32
tensor; all_reduce with mean or sum, all_gather stacked.
"""
from __future__ import annotations

import operator
import sys
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

_item = Tensor.item
_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")
_use_count = torch._C._storage_Use_Count
INLINE_BYTES = 8192
DEPTH = 3
POOLED = 8
CHUNKS = 4
#: torch >= 2.13's name for all_gather_into_tensor (the old one warns)
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
Floor = Callable[[Dict[str, Tensor]], Dict[str, Tensor]]


class _Slot:
    __slots__ = ("buffer", "views", "version", "uses")

    def __init__(self, buffer: Tensor, views: Sequence[Tensor]) -> None:
        self.buffer, self.views = buffer, tuple(views)
        self.uses = 2 + len(self.views)  # the buffer, its views, the storage handle that counts them
        self.version = -1

    def free(self) -> bool:
        buffer = self.buffer
        return (buffer._version == self.version and _use_count(buffer.untyped_storage()._cdata) == self.uses
                and set(map(sys.getrefcount, self.views)) == {2})


class Reuse:
    """Result buffers of one shape: ``take`` a free one (or a new one), write it, ``done`` it, hand out its
    views."""

    def __init__(self, shape: Tuple[int, ...], device: torch.device,
                 views: Callable[[Tensor], Sequence[Tensor]] = Tensor.unbind) -> None:
        self.shape, self.device, self.make_views = shape, device, views
        self.slots: List[_Slot] = []

    def take(self) -> _Slot:
        for slot in self.slots:
            if slot.free():
                return slot
        buffer = torch.empty(self.shape, dtype=torch.float32, device=self.device)
        slot = _Slot(buffer, self.make_views(buffer))
        if len(self.slots) < DEPTH:
            self.slots.append(slot)
        return slot

    @staticmethod
    def done(slot: _Slot) -> Tuple[Tensor, ...]:
        slot.version = slot.buffer._version
        return slot.views


def _whole(buffer: Tensor) -> Tuple[Tensor]:
    return (buffer.view(buffer.shape),)


class _Cache(dict):
    """Per-shape Reuse pools and kept wire buffers, made on first use."""

    def reuse(self, key: Any, shape: Tuple[int, ...], device: torch.device,
              views: Callable[[Tensor], Sequence[Tensor]] = Tensor.unbind) -> Reuse:
        pool = self.get(key)
        if pool is None:
            pool = self[key] = Reuse(shape, device, views)
        return pool

    def buffer(self, key: Any, shape: Tuple[int, ...], device: torch.device) -> Tensor:
        buf = self.get(key)
        if buf is None:
            buf = self[key] = torch.empty(shape, dtype=torch.float32, device=device)
        return buf


def _values(data: Dict[str, Tensor], device: torch.device) -> Tensor:
    if device.type == "cpu":
        return torch.tensor(list(map(_item, data.values())), dtype=torch.float32)
    return torch.stack(list(data.values()))  # no item() per leaf (a device sync each) on an accelerator


def _unchecked_reduce(world: int, mean: bool, device: torch.device) -> Floor:
    cache = _Cache()

    def scalars(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
        n = len(data)
        if n < POOLED:
            buf = _values(data, device)
            dist.all_reduce(buf)
            if mean:
                buf.div_(world)
            return dict(zip(data, buf.unbind()))
        # the wire buffer is kept, never handed out (a backend may hold it a moment after the collective); the
        # result is written into a pooled buffer on the way out: by the mean's division itself, or a copy
        wire = cache.buffer(("wire", n), (n,), device)
        wire.copy_(_values(data, device)) if device.type != "cpu" else _fill(wire, data)
        dist.all_reduce(wire)
        pool = cache.reuse(n, (n,), device)
        slot = pool.take()
        torch.div(wire, world, out=slot.buffer) if mean else slot.buffer.copy_(wire)
        return dict(zip(data, pool.done(slot)))

    def big(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
        (key, t), = data.items()
        pool = cache.reuse(("big", t.shape), tuple(t.shape), device, _whole)
        slot = pool.take()
        works = []
        for out, part in zip(slot.buffer.view(-1).chunk(CHUNKS), t.reshape(-1).chunk(CHUNKS)):
            torch.div(part, world, out=out) if mean else out.copy_(part)
            works.append(dist.all_reduce(out, async_op=True))
        for work in works:
            work.wait()
        return {key: pool.done(slot)[0]}

    def either(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
        return big(data) if len(data) == 1 and next(iter(data.values())).dim() else scalars(data)
    return either


def _fill(buf: Tensor, data: Dict[str, Tensor]) -> None:
    """``buf`` (a CPU float32 vector) := the leaves' values, through its numpy memory (no temporary tensor)."""
    buf.numpy()[:] = list(map(_item, data.values()))


def _unchecked_gather(world: int, device: torch.device) -> Floor:
    cache = _Cache()

    def scalars(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
        n = len(data)
        buf = _values(data, device)
        out = cache.buffer(("out", n), (world * n,), device)  # never handed out: kept
        _gather(out, buf)
        columns = out.view(world, n).t()
        if n < POOLED:
            return dict(zip(data, columns.contiguous().unbind()))
        pool = cache.reuse(n, (n, world), device)
        slot = pool.take()
        slot.buffer.copy_(columns)
        return dict(zip(data, pool.done(slot)))

    def big(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
        (key, t), = data.items()
        pool = cache.reuse(("big", t.shape), (world, *t.shape), device, _whole)
        slot = pool.take()
        _gather(slot.buffer.view(-1), t.reshape(-1))
        return {key: pool.done(slot)[0]}

    def either(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
        return big(data) if len(data) == 1 and next(iter(data.values())).dim() else scalars(data)
    return either


class _Tags:
    """The agreement part of floor (b): a 32-bit tag per (call, keys, dtypes, shapes), a one-word-per-rank
    exchange buffer, and the check."""

    def __init__(self, world: int, rank: int, call: str) -> None:
        self.world, self.rank, self.call = world, rank, call
        self.tags: Dict[Any, int] = {}
        self.word = torch.zeros(world, dtype=torch.int64)
        self.word_np = self.word.numpy()
        self.halves = self.word_np.view(np.uint32)
        self.floats = self.word_np.view(np.float32)

    def tag(self, data: Dict[str, Tensor]) -> int:
        values = data.values()
        key = (tuple(data), tuple(map(_dtype, values)), tuple(map(_shape, values)))
        tag = self.tags.get(key)
        if tag is None:
            tag = self.tags[key] = zlib.crc32(repr((self.call, key)).encode()) | 1
        return tag

    def check(self, tags: Any, mine: int) -> None:
        if (tags != mine).any():
            raise RuntimeError(f"ranks disagree: tags {list(tags)} (keys, dtypes or shapes differ)")

    def exchange_word(self, tag: int, value: float = 0.0) -> Any:
        """One int64 SUM all_reduce of one word per rank: this rank's float32 ``value`` and ``tag``."""
        self.word_np[:] = 0
        self.floats[2 * self.rank] = value
        self.halves[2 * self.rank + 1] = tag
        dist.all_reduce(self.word)
        self.check(self.halves[1::2], tag)
        return self.floats[0::2]


def _checked(world: int, rank: int, op: str, mean: bool, unchecked: Floor) -> Floor:
    tags = _Tags(world, rank, f"{op} {mean}")
    rows: Dict[int, Tuple[Tensor, Any, Tensor]] = {}
    cache = _Cache()
    cpu = torch.device("cpu")

    def call(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
        tag = tags.tag(data)
        n = len(data)
        first = next(iter(data.values()))
        if first.dim() or n * 4 + 8 > INLINE_BYTES:  # large: the tag alone, then floor (a)
            tags.exchange_word(tag)
            return unchecked(data)
        if n == 1:  # one float32 in one word per rank (a mean over 2**k ranks divided first: exact)
            (key, t), = data.items()
            if op == "all_reduce":
                values = tags.exchange_word(tag, t.item() / world if mean else t.item())
                total = np.add(values[0:1], values[1:2]) if world == 2 else np.add.reduce(values, keepdims=True)
                return {key: torch.from_numpy(total.reshape(()))}
            return {key: torch.from_numpy(tags.exchange_word(tag, t.item()).copy())}
        buffers = rows.get(n)
        if buffers is None:  # [tag, n float32 values] as int64 words, and every rank's rows: never handed out
            mine = torch.zeros(1 + (n + 1) // 2, dtype=torch.int64)
            buffers = rows[n] = (mine, mine.numpy(), torch.empty((world, mine.numel()), dtype=torch.int64))
        mine, mine_np, gathered = buffers
        mine_np[0] = tag
        mine_np[1:].view(np.float32)[:n] = list(map(_item, data.values()))
        _gather(gathered.view(-1), mine)
        tags.check(gathered[:, 0].numpy(), tag)
        values = gathered[:, 1:].view(torch.float32)[:, :n]
        if op == "all_reduce":
            if n < POOLED:
                out = values.sum(0)
                if mean:
                    out.div_(world)
                return dict(zip(data, out.unbind()))
            pool = cache.reuse(n, (n,), cpu)
            slot = pool.take()
            torch.sum(values, 0, out=slot.buffer)
            if mean:
                slot.buffer.div_(world)
            return dict(zip(data, pool.done(slot)))
        if n < POOLED:
            return dict(zip(data, values.t().contiguous().unbind()))
        pool = cache.reuse(n, (n, world), cpu)
        slot = pool.take()
        slot.buffer.copy_(values.t())
        return dict(zip(data, pool.done(slot)))
    return call


def floors(op: str, reduce_op: str, device: Optional[torch.device] = None) -> Dict[str, Floor]:
    """``{"floor (a)": fn, "floor (b)": fn}`` for ``op`` (all_reduce / all_gather) on the default group;
    floor (b) only for CPU tensors (gloo)."""
    device = device or torch.device("cpu")
    world, rank = dist.get_world_size(), dist.get_rank()
    mean = reduce_op == "mean"
    unchecked = _unchecked_reduce(world, mean, device) if op == "all_reduce" else _unchecked_gather(world, device)
    out = {"floor (a)": unchecked}
    if device.type == "cpu":
        out["floor (b)"] = _checked(world, rank, op, mean, unchecked)
    return out
