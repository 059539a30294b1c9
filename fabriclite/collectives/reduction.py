"""all_reduce and reduce over nested collections, as one pipeline; each stage is one function here, called
once per call, in this order, by ``run``:

    flatten -> plan (cached) -> pack -> agree -> wire -> unpack -> rebuild

- ``flatten`` (tree.py): the caller's leaves in order and the structure.
- ``plan``: all that depends only on the structure, the leaves' metadata and the call's arguments, made once
  and cached (plans.py): the op, the buckets, the call's tag, and the checks: a bad ``reduce_op`` or ``dst``,
  an op a dtype does not take, a result ``inplace=True`` cannot hold, raised before any communication.
- ``pack``: the leaves' values into the header's payload (inline) or into one wire buffer per bucket.
- ``agree``: the header exchange (header.py), which carries the data itself when it is inline; on a
  disagreement every rank raises the same CollectiveMismatchError there.
- ``wire``: one primitive all_reduce per bucket, or, inline, the reduction of every rank's row here.
- ``unpack``: a result per leaf: new tensors, or the caller's own tensors written in place (``inplace``).
- ``rebuild`` (tree.py): the caller's containers and key order.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from fabriclite.collectives import buffers, header, ops
from fabriclite.collectives.plans import Plan, plan_reduce
from fabriclite.collectives.pool import POOL_MIN_BYTES, POOL_MIN_LEAVES, Slot, pool_of
from fabriclite.collectives.spec import TENSOR, Bucket
from fabriclite.collectives.state import Context
from fabriclite.collectives.tree import flatten, rebuild

#: per bucket: the reduced (or to be reduced) wire buffer, whether a mean was divided while packing, the
#: pool slot it is, and the caller's tensor still to be copied into it (by the reduction, which overlaps
#: the two), if any; or, inline on CPU, the reduced values as a numpy array
Reduced = Tuple[Any, bool, Optional[Slot], Optional[Tensor]]
_copy_all = getattr(torch, "_foreach_copy_", None)
#: autograd off and on again without a context manager object per call
_set_grad = getattr(torch._C, "_set_grad_enabled", torch.set_grad_enabled)


def run(ctx: Context, data: Any, reduce_op: Any, check: bool, kind: int = header.ALL_REDUCE,
        dst: Optional[int] = None, inplace: bool = False) -> Any:
    """Reduce ``data`` over ``ctx``'s group (see ``fabriclite.collectives.all_reduce``); for ``kind`` REDUCE
    only the rank ``dst`` gets the result (None elsewhere). Runs without autograd (results are not
    differentiable; in-place writes into tensors that require grad are allowed)."""
    grad = torch.is_grad_enabled()
    if grad:
        _set_grad(False)
    try:
        return _run(ctx, data, reduce_op, check, kind, dst, inplace)
    finally:
        if grad:
            _set_grad(True)


def _run(ctx: Context, data: Any, reduce_op: Any, check: bool, kind: int, dst: Optional[int],
         inplace: bool) -> Any:
    checked = check and ctx.size > 1
    words = None
    try:
        tree, leaves = flatten(data)
        plan = plan_reduce(ctx, tree, leaves, reduce_op, kind, dst, inplace)
        words = header.begin(ctx) if checked else None
        inline = words is not None and words.fits(plan.layout.used)
        packed = pack(ctx, plan, leaves, words if inline else None)
    except Exception as err:  # on one rank only, maybe: every rank must hear of it
        if not checked:
            raise
        header.fail(ctx, header.Call(kind, ops.OP_CODES.get(_op_name(reduce_op), 0), -1 if dst is None else dst),
                    err)
    if words is not None:
        agree(ctx, plan, words, inline)
    reduced = wire(ctx, plan, packed, words if inline else None)
    if dst is not None and ctx.ranks[ctx.index] != dst:
        if inplace:  # every rank's tensors hold the result
            unpack(ctx, plan, leaves, reduced)
        return None
    return rebuild(tree, unpack(ctx, plan, leaves, reduced), data)


def _op_name(reduce_op: Any) -> str:
    try:
        return ops.parse_reduce_op(reduce_op)
    except ValueError:
        return ""


# ---------------------------------------------------------------------------------------------- pack
def pack(ctx: Context, plan: Plan, leaves: Sequence[Any], words: Optional[header.Words]) -> List[Reduced]:
    """The leaves' values on the wire: written into the header's payload when ``words`` is given (inline:
    nothing else to send), else one wire buffer per bucket (a mean over a power-of-two group divided while
    packing; a large single tensor left to the reduction to copy, or, ``inplace``, reduced where it is)."""
    if words is not None:
        buffers.write_inline(plan.layout.buckets, leaves, words.payload, words.payload_np, ctx.device,
                             plan.divisors)
        return []
    out: List[Reduced] = []
    for bucket, divisor in zip(plan.layout.buckets, plan.divisors):
        direct = plan.direct_tensor(bucket, leaves, ctx.device) if plan.inplace else None
        if direct is not None:  # the caller's tensor is the wire buffer: a mean divided in place, chunk by
            # chunk while the chunks before are reduced (by the reduction, after the agreement)
            split = divisor is not None and ctx.size > 1
            out.append((direct, split, None, direct if split else None))
            continue
        if ctx.size == 1:  # one rank: the reduction of one row is a copy
            out.append((buffers.pack(bucket, leaves, ctx.device, copy=True), False, None, None))
            continue
        slot = None if plan.inplace else _pooled_single(ctx, bucket, leaves)
        if slot is not None:
            out.append((slot.buffer, divisor is not None, slot, bucket.take(leaves)[0]))
        else:
            out.append((buffers.pack(bucket, leaves, ctx.device, copy=True, divisor=divisor), divisor is not None,
                        None, None))
    return out


def _pooled_single(ctx: Context, bucket: Bucket, leaves: Sequence[Any]) -> Optional[Slot]:
    """A reused wire buffer (warm memory: no page faults) for a large single tensor, or None; the tensor is
    copied into it later, by the reduction."""
    if bucket.mode != "single" or bucket.nbytes < POOL_MIN_BYTES or bucket.wire != bucket.result:
        return None
    source = bucket.take(leaves)[0]
    if source.dtype != bucket.wire:
        return None
    shape = bucket.shapes[0]
    return pool_of(bucket, "wire", lambda b: (b.view(shape),)).acquire((bucket.numel,), bucket.wire, ctx.device)


# ---------------------------------------------------------------------------------------------- agree
def agree(ctx: Context, plan: Plan, words: header.Words, inline: bool) -> None:
    """The header exchange: this call's tag and size (or, at width 1, its 4-byte payload) against every
    rank's; CollectiveMismatchError on every rank when they differ."""
    low = None if inline and words.width == 1 else header.units(plan.layout.used)
    halves = header.exchange(ctx, words, plan.tag, low)
    header.agree(ctx, words, halves, plan.call, plan.describe)


# ---------------------------------------------------------------------------------------------- wire
def wire(ctx: Context, plan: Plan, packed: List[Reduced], words: Optional[header.Words]) -> List[Reduced]:
    """The reduction: inline (``words``), every rank's row reduced here (numpy for the 0-d CPU buckets it
    reduces exactly as torch would); else one primitive all_reduce per wire buffer (in place; a pooled
    single tensor is copied in by the strategy's all_reduce_copy, overlapping the copy with the reduction)."""
    if words is not None:
        rows = words.rows()
        out: List[Reduced] = []
        for bucket, divisor in zip(plan.layout.buckets, plan.divisors):
            values = plan.inline_numpy(bucket, words)
            if values is not None:
                out.append((plan.reduce_numpy(values), divisor is not None, None, None))
            else:
                out.append((ops.reduce_rows(buffers.inline_rows(rows, bucket), plan.op), divisor is not None,
                            None, None))
        return out
    if ctx.size == 1:
        return packed
    out = []
    for buf, divided, slot, source in packed:
        flat = buf.view(-1)
        if source is not None:  # source may be buf itself (inplace): the copy is then the division alone
            result = ctx.strategy.flat_all_reduce_copy(flat, source.reshape(-1), plan.primitive, ctx.group,
                                                       ctx.size if divided else None)
        else:
            result = ctx.strategy.flat_all_reduce(flat, plan.primitive, ctx.group)
        result = buf if result is flat else result.view(buf.shape)
        out.append((result, divided, slot if result is buf else None, None))
    return out


# ---------------------------------------------------------------------------------------------- unpack
def unpack(ctx: Context, plan: Plan, leaves: Sequence[Any], reduced: List[Reduced]) -> List[Any]:
    """One result per leaf, in the caller's order: reduced tensors and numbers as tensors (the mean divided,
    the result dtype), other leaves as they were; with ``inplace``, tensor leaves are the caller's own tensors,
    now holding the result."""
    outs = list(leaves)
    size = ctx.size
    for bucket, (buf, divided, slot, _) in zip(plan.layout.buckets, reduced):
        if isinstance(buf, np.ndarray):
            pieces = _numpy_pieces(buf, bucket, plan.op == "mean" and not divided, size)
        else:
            flat = ops.finish(buf, plan.op, bucket.result, size, divided=divided)
            if plan.inplace and bucket.mode == "single" and flat is leaves[bucket.ids[0]]:
                pieces = (flat,)  # reduced where it is
            elif slot is not None and flat is slot.buffer:
                slot.commit()
                pieces = slot.views
            else:
                pieces = buffers.split_flat(flat, bucket)
        if plan.inplace and plan.tensor_ids(bucket):
            pieces = _into_callers(plan, bucket, leaves, pieces)
        outs = buffers.place_results(outs, bucket, pieces)
        if bucket.elsewhere(ctx.device) and not plan.inplace:
            buffers.to_devices(outs, bucket.ids, bucket.devices, ctx.device)
    return outs


def _numpy_pieces(values: Any, bucket: Bucket, divide: bool, size: int) -> Sequence[Tensor]:
    """Per-leaf 0-d tensors from the reduced values of a 0-d bucket (canonical order; a mean divided by
    ``size`` when ``divide``), in the caller's order for a whole bucket."""
    if divide:
        values = values / size
    if bucket.perm is not None:
        values = values[bucket.inverse_np()]
    if len(values) == 1:
        return (torch.from_numpy(values.reshape(())),)
    flat = torch.from_numpy(values)
    return pool_of(bucket, "flat").views(flat) if len(values) >= POOL_MIN_LEAVES else flat.unbind()


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

