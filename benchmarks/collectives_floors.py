"""The floors of benchmarks/collectives.py: hand-written paths, one per case, that do the least Python a
collection-aware collective must do for that case and nothing more.

- Floor (a): read the leaves' values into one flat buffer, run one torch.distributed collective, hand the
  results back in the same structure and types (a dict of new tensors; the input is not modified). No
  agreement check: a rank with other keys, dtypes or shapes gets garbage or a hang.
- Floor (b): (a) with the least agreement check: a tag cached per (keys, dtypes, shapes), read per call,
  travels with the data in the same collective and is compared on every rank. Rows of at most 8 KiB ride
  whole in that collective (the data reduced from every rank's row on every rank); a one-leaf float32
  row rides in one int64 word per rank through an all_reduce sum (each rank's word at its index), gloo's
  cheapest collective; larger data sends the tag that way first, then runs (a).

The cases are those of the benchmark: a dict of ``n`` 0-d float32 CPU tensors, or of one large float32
tensor; all_reduce with mean or sum, all_gather stacked.
"""
from __future__ import annotations

import operator
import zlib
from typing import Any, Callable, Dict, Tuple

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

_item = Tensor.item
_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")
INLINE_BYTES = 8192


def _unchecked_reduce(world: int, mean: bool) -> Callable[[Dict[str, Tensor]], Dict[str, Tensor]]:
    def scalars(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
        buf = torch.tensor(list(map(_item, data.values())), dtype=torch.float32)
        dist.all_reduce(buf)
        if mean:
            buf.div_(world)
        return dict(zip(data, buf.unbind()))

    def big(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
        (key, t), = data.items()
        flat = t.reshape(-1)
        buf = torch.div(flat, world) if mean else flat.clone()
        dist.all_reduce(buf)
        return {key: buf.view(t.shape)}

    def either(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
        return big(data) if len(data) == 1 and next(iter(data.values())).dim() else scalars(data)
    return either


def _unchecked_gather(world: int) -> Callable[[Dict[str, Tensor]], Dict[str, Tensor]]:
    def scalars(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
        buf = torch.tensor(list(map(_item, data.values())), dtype=torch.float32)
        out = torch.empty(world * buf.numel(), dtype=torch.float32)
        dist.all_gather_into_tensor(out, buf)
        return dict(zip(data, out.view(world, -1).t().contiguous().unbind()))

    def big(data: Dict[str, Tensor]) -> Dict[str, Tensor]:
        (key, t), = data.items()
        out = torch.empty((world, *t.shape), dtype=t.dtype)
        dist.all_gather_into_tensor(out.view(-1), t.reshape(-1))
        return {key: out}

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


def _checked(world: int, rank: int, op: str, mean: bool,
             unchecked: Callable[[Dict[str, Tensor]], Dict[str, Tensor]]) -> Callable[[Dict[str, Tensor]], Any]:
    tags = _Tags(world, rank, f"{op} {mean}")
    rows: Dict[int, Tuple[Tensor, Any, Tensor]] = {}

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
        if buffers is None:  # [tag, n float32 values] as int64 words, and every rank's rows
            mine = torch.zeros(1 + (n + 1) // 2, dtype=torch.int64)
            buffers = rows[n] = (mine, mine.numpy(), torch.empty((world, mine.numel()), dtype=torch.int64))
        mine, mine_np, gathered = buffers
        mine_np[0] = tag
        mine_np[1:].view(np.float32)[:n] = list(map(_item, data.values()))
        dist.all_gather_into_tensor(gathered.view(-1), mine)
        tags.check(gathered[:, 0].numpy(), tag)
        values = gathered[:, 1:].view(torch.float32)[:, :n]
        if op == "all_reduce":
            out = values.sum(0)
            if mean:
                out.div_(world)
            return dict(zip(data, out.unbind()))
        return dict(zip(data, values.t().contiguous().unbind()))
    return call


def floors(op: str, reduce_op: str) -> Dict[str, Callable[[Dict[str, Tensor]], Any]]:
    """``{"floor (a)": fn, "floor (b)": fn}`` for ``op`` (all_reduce / all_gather) on the default group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mean = reduce_op == "mean"
    unchecked = _unchecked_reduce(world, mean) if op == "all_reduce" else _unchecked_gather(world)
    return {"floor (a)": unchecked, "floor (b)": _checked(world, rank, op, mean, unchecked)}
