"""Result buffers reused across calls, once nothing outside the pool can see them.

Creating one tensor per leaf (``unbind``) costs more than the collective for a dict of many scalars, and
a fresh multi-megabyte buffer costs a page fault per page on first touch. So a bucket keeps up to
POOL_DEPTH buffers with the per-leaf views it handed out, and hands the same view objects out again
with new values when no Python reference to any of them is left, no other tensor shares the buffer's
memory (a view, ``.numpy()``, a tensor saved for backward), no in-place change and no ``requires_grad``
happened since. Otherwise a new buffer is used, so results a caller keeps are never changed.
"""
from __future__ import annotations

import operator
import sys
from typing import Any, Callable, List, Sequence, Tuple

import torch
from torch import Tensor

_use_count = getattr(torch._C, "_storage_Use_Count", None)
_requires_grad = operator.attrgetter("requires_grad")
POOL_DEPTH = 3
#: buckets with fewer 0-d leaves than this just unbind (a few new tensors cost less than the checks)
POOL_MIN_LEAVES = 8
#: single tensors at least this large reuse their wire buffer
POOL_MIN_BYTES = 1 << 16
Views = Callable[[Tensor], Sequence[Tensor]]


def _unbind(buffer: Tensor) -> Sequence[Tensor]:
    return buffer.unbind()


class Slot:
    """One buffer and the views of it handed out; ``commit`` after writing to it."""

    def __init__(self, buffer: Tensor, make_views: Views) -> None:
        self.buffer = buffer
        self.views = tuple(make_views(buffer))
        self.commit()

    def _uses(self) -> int:
        return int(_use_count(self.buffer.untyped_storage()._cdata)) if _use_count is not None else -1

    def commit(self) -> None:
        """Record the buffer's state as handed out (after the last write to it). The memory's expected
        users are the buffer, its views and the storage handle ``_uses`` makes; counted, not measured,
        since a backend may still hold the buffer of a finished collective for a moment."""
        self.version = self.buffer._version
        self.uses = 2 + len(self.views)

    def free(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
        buffer = self.buffer
        return (buffer.shape == shape and buffer.dtype == dtype and buffer.device == device
                and buffer._version == self.version and self._uses() == self.uses
                and set(map(sys.getrefcount, self.views)) == {2} and not any(map(_requires_grad, self.views)))


class Pool:
    """Up to POOL_DEPTH slots whose views are made by ``make_views`` (default: ``unbind``)."""

    def __init__(self, make_views: Views = _unbind) -> None:
        self.make_views = make_views
        self.slots: List[Slot] = []

    def _free(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Any:
        if _use_count is None:
            return None
        for slot in self.slots:
            if slot.free(shape, dtype, device):
                return slot
        return None

    def _keep(self, slot: Slot) -> Slot:
        if _use_count is not None and len(self.slots) < POOL_DEPTH:
            self.slots.append(slot)
        return slot

    def views(self, result: Tensor) -> Sequence[Tensor]:
        """Views holding ``result``'s values: a free slot's, refilled, or ``result``'s own (kept as a slot)."""
        slot = self._free(tuple(result.shape), result.dtype, result.device)
        if slot is None:
            return self._keep(Slot(result, self.make_views)).views
        slot.buffer.copy_(result)
        slot.commit()
        return slot.views

    def acquire(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Slot:
        """A slot to write into (a free one, or a new empty buffer); ``commit`` it once written."""
        slot = self._free(shape, dtype, device)
        if slot is None:
            slot = self._keep(Slot(torch.empty(shape, dtype=dtype, device=device), self.make_views))
        return slot


def pool_of(owner: Any, kind: str, make_views: Views = _unbind) -> Pool:
    """The pool named ``kind`` kept on ``owner`` (a Bucket) in its ``cache`` dict."""
    pool = owner.cache.get(kind)
    if pool is None:
        pool = owner.cache[kind] = Pool(make_views)
    return pool
