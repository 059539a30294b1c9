"""Stages 6 and 7 of every collective: unpack (a result per leaf) and rebuild (the caller's containers).

A reduced buffer becomes the caller's view of it (a mean divided, the result dtype) split into per-leaf
results, or, with ``inplace=True``, written into the caller's own tensors; gathered rows are split into
stacked (or concatenated) leaves and pickled leaves loaded; a broadcast's message is unpickled, its tensors
read from the bytes after it. Every pickle from another rank is loaded with the restricted unpickler
(``object_pickle``): a class it does not allow raises ``pickle.UnpicklingError`` naming it. ``rebuild`` gives
back the caller's own container types and key order.

Result buffers are reused across calls once nothing outside can see them (``Pool``): a tensor per leaf
(``unbind``) costs more than the collective for a dict of many scalars, and a fresh multi-megabyte buffer a
page fault per page on first touch.
"""
from __future__ import annotations

import copy
import io
import math
import pickle
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from fabriclite.collectives.autograd import attach_gather_grads
from fabriclite.collectives.buffers import DETACH_BYTES, POOL_MIN_LEAVES, SKELETON_AT, Slot, pool_of, stacked_slot
from fabriclite.collectives.header import Gathered
from fabriclite.collectives.object_pickle import SafeUnpickler, check_shape, dtype_named, loads
from fabriclite.collectives.plans import Bucket, GatherPlan, Layout, Plan, align
from fabriclite.collectives.state import Context
from fabriclite.collectives.structure import DATACLASS, LEAF, MAPPING, NAMEDTUPLE, TENSOR, Spec, Tree

_copy_all = getattr(torch, "_foreach_copy_", None)

# ---------------------------------------------------------------------------------------------- reductions
def reduced(ctx: Context, plan: Plan, leaves: Sequence[Any], wired: List[Tuple[Any, Optional[Slot]]], tree: Tree,
            data: Any, keep: bool) -> Any:
    """A reduction's result from ``wired`` (per bucket: the reduced buffer or numpy array, its pool slot):
    ``data`` rebuilt with reduced tensors and numbers as tensors, other leaves as they were, and with
    ``inplace`` the caller's own tensors holding the result; None where not ``keep`` (the caller's tensors
    written all the same)."""
    outs = list(leaves)
    inplace = plan.inplace
    for k, bucket in enumerate(plan.buckets):
        flat, slot = wired[k]
        if isinstance(flat, np.ndarray):
            if slot is not None:  # reduced into the slot's buffer (in the caller's order)
                slot.commit()
                pieces = slot.views
            else:
                pieces = _numpy_pieces(flat, bucket)
        elif inplace and bucket.mode == "single" and flat is leaves[bucket.ids[0]]:
            pieces = (flat,)  # reduced where it is
        elif slot is not None and flat is slot.buffer:
            slot.commit()
            pieces = slot.views
        else:
            pieces = _split_flat(flat, bucket)
        if inplace and plan.tensors[k]:
            pieces = _into_callers(plan, bucket, leaves, pieces)
        outs = _place_results(outs, bucket, pieces)
        if bucket.elsewhere[ctx.device] and not inplace:
            _to_devices(outs, bucket.ids, bucket.devices, ctx.device)
    return rebuild(tree, outs, data) if keep else None


def _numpy_pieces(values: Any, bucket: Bucket) -> Sequence[Tensor]:
    """Per-leaf 0-d tensors from the reduced values of a 0-d bucket (canonical order), in the caller's order
    for a whole bucket."""
    if bucket.perm is not None:
        values = values[bucket.inverse_np]
    if len(values) == 1:
        return (torch.from_numpy(values.reshape(())),)
    flat = torch.from_numpy(values)
    return pool_of(bucket, "flat").views(flat) if len(values) >= POOL_MIN_LEAVES else flat.unbind()


def _split_flat(flat: Tensor, bucket: Bucket) -> Sequence[Tensor]:
    """A reduced bucket ``(numel,)`` as one tensor per leaf, shaped like the leaves: in the caller's order
    for a whole 0-d bucket, else in the bucket's (canonical) order."""
    if bucket.scalar:
        if bucket.perm is not None:
            flat = flat.index_select(0, bucket.index[flat.device][1])
        return pool_of(bucket, "flat").views(flat) if len(bucket.ids) >= POOL_MIN_LEAVES else flat.unbind()
    if bucket.mode == "single":
        return (flat.view(bucket.shapes[0]),)
    pieces = [p.view(s) for p, s in zip(flat.split(bucket.numels), bucket.shapes)]
    if flat.numel() * flat.element_size() > DETACH_BYTES:
        pieces = [p.clone() for p in pieces]
    return pieces


def _into_callers(plan: Plan, bucket: Bucket, leaves: Sequence[Any], pieces: Sequence[Any]) -> List[Any]:
    """``inplace``: the results of the bucket's tensor leaves copied into the caller's tensors, which take
    their places among the results (numbers keep their new tensors)."""
    ids = bucket.ids if not (bucket.whole and bucket.scalar) else range(len(bucket.ids))
    out = list(pieces)
    targets, sources = [], []
    for k, i in enumerate(ids):
        leaf = leaves[i]
        if plan.leaf_kinds[i] == TENSOR:
            if out[k] is not leaf:
                targets.append(leaf)
                sources.append(out[k])
            out[k] = leaf
    if targets:
        if _copy_all is not None:
            _copy_all(targets, sources)
        else:  # pragma: no cover - torch without _foreach_copy_
            for target, source in zip(targets, sources):
                target.copy_(source)
    return out


# ---------------------------------------------------------------------------------------------- gathers
def gathered(ctx: Context, spec: Spec, plan: GatherPlan, leaves: Sequence[Any], got: Gathered, tree: Tree,
             data: Any, sync_grads: bool, slots: Optional[Dict[Any, Any]] = None) -> Any:
    """An all_gather's result: ``data`` rebuilt with every rank's leaves, stacked ``(size, *shape)`` for fixed
    leaves, concatenated for var tensors, lists for objects (one process without process groups: no stacking
    dim). ``sync_grads``: differentiable outputs for the inputs that require grad. ``slots``: per bucket index,
    its result buffer found beforehand (``buffers.stacked_slot``), and under "result" the result built around
    its views (one bucket holding every leaf): only the values are written then."""
    layout = plan.layout
    early = slots.get("result") if slots else None
    if early is not None:
        assert slots is not None and got.slot is None
        _split_stacked(got.regions[0], layout.buckets[0], slots[0])
        return early
    outs: List[Any] = list(leaves)
    shapes: List[List[Tuple[int, ...]]] = [[] for _ in layout.var_ids]
    with torch.no_grad():
        for k, bucket in enumerate(layout.buckets):
            pieces = (got.slot.views if got.slot is not None
                      else _split_stacked(got.regions[k], bucket, slots.get(k) if slots else None))
            outs = _place_results(outs, bucket, pieces)
            if bucket.elsewhere[ctx.device]:
                _to_devices(outs, bucket.ids, bucket.devices, ctx.device)
        if not layout.fixed_only:
            assert got.rows is not None
            per_rank = [_rank_leaves(spec, layout, got.rows[r]) for r in range(got.rows.shape[0])]
            for k, i in enumerate(layout.var_ids):
                pieces = [tensors[k] for tensors, _ in per_rank]
                shapes[k] = [tuple(p.shape) for p in pieces]
                device = spec.leaves[i].device
                outs[i] = torch.cat(pieces).to(device if device is not None else ctx.device)
            for k, i in enumerate(layout.object_ids):
                outs[i] = [objects[k] for _, objects in per_rank]
    if sync_grads and torch.is_grad_enabled():
        outs = attach_gather_grads(ctx, spec, layout, leaves, outs, shapes)
    if ctx.single_device:  # Lightning's contract for one process: no stacking dim
        for bucket in layout.buckets:
            for i in bucket.ids:
                outs[i] = outs[i][0]
    return rebuild(tree, outs, data)


def gathered_per_rank(spec: Spec, layout: Layout, leaves: Sequence[Any], rows: Tensor, tree: Tree,
                      data: Any) -> List[Any]:
    """gather's result on ``dst``: ``data`` rebuilt once per rank from that rank's row (tensors cloned)."""
    out = []
    for r in range(rows.shape[0]):
        tensors, objects = _rank_leaves(spec, layout, rows[r])
        rank_leaves = list(leaves)
        _place(rank_leaves, layout.var_ids, [t.clone() for t in tensors])
        _place(rank_leaves, layout.object_ids, objects)
        out.append(rebuild(tree, rank_leaves, data))
    return out


def _rank_leaves(spec: Spec, layout: Layout, row: Tensor) -> Tuple[List[Tensor], List[Any]]:
    """One rank's var tensors (views of ``row``) and unpickled object leaves."""
    words = row[: 8 * layout.nvar].view(torch.int64).tolist() if layout.nvar else []
    tensors, offset, w = [], layout.fixed_end, 0
    for i in layout.var_ids:
        leaf = spec.leaves[i]
        assert leaf.dtype is not None
        if layout.var_dims == "first":
            shape: Tuple[int, ...] = (words[w], *leaf.shape[1:])
            w += 1
        else:
            shape = tuple(words[w:w + len(leaf.shape)])
            w += len(leaf.shape)
        nbytes = math.prod(shape) * leaf.dtype.itemsize
        tensors.append(row[offset:offset + nbytes].view(leaf.dtype).view(shape))
        offset = align(offset + nbytes)
    objects: List[Any] = []
    if layout.object_ids:
        objects = loads(row[offset:].cpu().numpy().tobytes())
    return tensors, objects


def _split_stacked(region: Tensor, bucket: Bucket, slot: Optional[Slot] = None) -> Sequence[Tensor]:
    """A gathered bucket ``(size, numel)`` as one contiguous ``(size, *shape)`` tensor per leaf (a 0-d bucket of
    POOL_MIN_LEAVES or more: views of its result buffer ``slot``, found now when not given)."""
    size = region.shape[0]
    if bucket.scalar:
        if len(bucket.ids) >= POOL_MIN_LEAVES:  # one copy into a reused (leaves, size) buffer, its views handed out
            if slot is None:
                slot = stacked_slot(bucket, size, region.device)
            if bucket.perm is not None:  # columns to the caller's order (contiguous rows: fast), then transposed
                scratch = bucket.cache.get("gather scratch")
                if scratch is None or scratch.shape != region.shape or scratch.device != region.device:
                    scratch = bucket.cache["gather scratch"] = torch.empty(region.shape, dtype=region.dtype,
                                                                           device=region.device)
                region = torch.index_select(region, 1, bucket.index[region.device][1], out=scratch)
            slot.buffer.copy_(region.t())
            slot.commit()
            return slot.views
        if bucket.perm is not None:
            region = region.index_select(1, bucket.index[region.device][1])
        return region.t().contiguous().unbind()
    if bucket.mode == "single":
        return (region.reshape(size, *bucket.shapes[0]).contiguous(),)
    out, start = [], 0
    for numel, shape in zip(bucket.numels, bucket.shapes):
        out.append(region[:, start:start + numel].reshape(size, *shape).contiguous())
        start += numel
    return out


# ---------------------------------------------------------------------------------------------- broadcasts
class _Unpickler(SafeUnpickler):
    """The restricted unpickler (``object_pickle``) reading a broadcast's tensors from the bytes after its skeleton."""

    def __init__(self, file: io.BytesIO, data: Tensor) -> None:
        super().__init__(file)
        self.data = data
        self.offset = 0

    def persistent_load(self, pid: Any) -> Tensor:
        if not (isinstance(pid, tuple) and len(pid) == 3):
            return super().persistent_load(pid)
        _, dtype_name, shape = pid
        dtype, shape = dtype_named(dtype_name), check_shape(shape)
        start, nbytes = self.offset, math.prod(shape) * dtype.itemsize
        if start + nbytes > self.data.numel():
            raise pickle.UnpicklingError(f"fabriclite: a broadcast's tensor {shape} {dtype} lies past the end of its "
                                         f"message ({self.data.numel()} bytes).")
        self.offset = align(start + nbytes)
        out = self.data[start:start + nbytes].view(dtype).view(shape)
        if self.data.numel() > DETACH_BYTES and nbytes < self.data.numel():
            out = out.clone()  # one kept tensor must not pin the whole buffer
        return out


def unpickled(skeleton: Optional[bytes], data: Tensor) -> Any:
    """A broadcast's object: ``skeleton`` (the pickle, its tensors left out) loaded with its tensors read from
    ``data``; without ``skeleton``, ``data`` is the whole message (skeleton length, skeleton, tensor bytes)."""
    if skeleton is None:
        start = SKELETON_AT + int(data[:8].view(torch.int64).item())
        skeleton, data = data[SKELETON_AT:start].cpu().numpy().tobytes(), data[align(start):]
    return _Unpickler(io.BytesIO(skeleton), data).load()


# ---------------------------------------------------------------------------------------------- results
def _place(outs: List[Any], ids: Sequence[int], pieces: Sequence[Any]) -> None:
    for i, piece in zip(ids, pieces):
        outs[i] = piece


def _to_devices(outs: List[Any], ids: Sequence[int], devices: Sequence[Optional[torch.device]],
                here: torch.device) -> None:
    """Move results whose leaf lived on another device than ``here`` back to that device."""
    for i, device in zip(ids, devices):
        if device is not None and device != here:
            outs[i] = outs[i].to(device)


def _place_results(outs: List[Any], bucket: Bucket, pieces: Sequence[Any]) -> List[Any]:
    """``outs`` with the bucket's results in: the pieces themselves when they are every leaf in the caller's
    order (whole 0-d buckets), else placed by index."""
    if bucket.whole and bucket.scalar:
        return list(pieces)
    _place(outs, bucket.ids, pieces)
    return outs


# ---------------------------------------------------------------------------------------------- rebuild
def rebuild(tree: Tree, leaves: Sequence[Any], like: Any) -> Any:
    """The collection with structure ``tree`` holding ``leaves`` (in the order ``flatten`` gave them);
    ``like`` is the collection that was flattened (dataclasses are copied from it)."""
    if tree is LEAF:
        return leaves[0]
    kind, cls, keys, children, _ = tree
    if children is None:
        values: List[Any] = list(leaves)
    else:
        it = iter(leaves)
        values = [_build(child, it, item) for child, item in zip(children, _items(tree, like))]
    return _make(tree, values, like)


def _build(tree: Tree, it: Iterator[Any], like: Any) -> Any:
    if tree is LEAF:
        return next(it)
    kind, cls, keys, children, _ = tree
    if children is None:
        count = keys if isinstance(keys, int) else len(keys)
        values = [next(it) for _ in range(count)]
    else:
        values = [_build(child, it, item) for child, item in zip(children, _items(tree, like))]
    return _make(tree, values, like)


def _items(tree: Tree, like: Any) -> List[Any]:
    kind, cls, keys, _, _ = tree
    if kind == MAPPING:
        return [like[k] for k in keys]
    if kind == DATACLASS:
        return [getattr(like, name) for name in keys]
    return list(like)


def _make(tree: Tree, values: List[Any], like: Any) -> Any:
    kind, cls, keys, _, extra = tree
    if kind == MAPPING:
        pairs = zip(keys, values)
        if cls is dict:
            return dict(pairs)
        if extra is not None or hasattr(like, "default_factory"):
            return cls(extra, pairs)
        try:
            return cls(pairs)
        except TypeError:
            return dict(zip(keys, values))
    if kind == NAMEDTUPLE:
        return cls(*values)
    if kind == DATACLASS:
        out = copy.copy(like)
        for name, value in zip(keys, values):
            object.__setattr__(out, name, value)
        return out
    if cls is list or cls is tuple:
        return cls(values)
    try:
        return cls(values)
    except TypeError:
        return list(values) if isinstance(like, list) else tuple(values)
