"""all_reduce and reduce over nested collections: one header exchange, which carries the data itself when it
fits (every rank then reducing every rank's copy), else one primitive all_reduce per bucket after it."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fabriclite.collectives import buffers, header, ops
from fabriclite.collectives.pool import POOL_MIN_BYTES, Slot, pool_of
from fabriclite.collectives.spec import Bucket, Layout
from fabriclite.collectives.state import Context
from fabriclite.collectives.tree import flatten, rebuild


#: a wire buffer, whether a mean is divided while packing, the pool slot it is, and the caller's tensor
#: still to be copied into it (by the reduction itself, which overlaps the two), if any
Reduced = Tuple[Tensor, bool, Optional[Slot], Optional[Tensor]]


@torch.no_grad()
def run(ctx: Context, data: Any, reduce_op: Any, check: bool, kind: int = header.ALL_REDUCE,
        dst: Optional[int] = None) -> Any:
    """Reduce ``data`` over ``ctx``'s group (see ``fabriclite.collectives.all_reduce``); for ``kind`` REDUCE
    only the rank ``dst`` gets the result (None elsewhere)."""
    root = -1 if dst is None else dst
    call = header.Call(kind, root=root)
    checked = check and ctx.size > 1
    try:
        tree, leaves = flatten(data)
        spec = ctx.state.specs.get(tree, leaves)
        op = ops.parse_reduce_op(reduce_op)
        call = header.Call(kind, ops.OP_CODES[op], root)
        ops.check_supported(op, ctx.strategy.supported_reduce_ops)
        if dst is not None:
            ctx.member_index(dst, f"dst={dst}")
        layout = spec.reduce_layout(op)
        words = header.begin(ctx) if checked else None
        inline = words is not None and words.fits(layout.used)
        if inline:  # the data rides in the header: one collective in all
            buffers.write_inline(layout.buckets, leaves, words.payload, words.payload_np, ctx.device)
            wire: List[Reduced] = []
        else:  # packed before the header, so that a failure to pack is reported to every rank
            wire = _local(ctx, layout, leaves) if ctx.size == 1 else _pack(ctx, layout, leaves, op)
    except Exception as err:  # on one rank only, maybe: every rank must hear of it
        if not checked:
            raise
        header.fail(ctx, call, err)
    if words is not None:
        call = call._replace(digest=spec.digest("reduce"), fixed=layout.fixed_end)
        low = None if inline and words.width == 1 else header.units(layout.used)
        halves = header.exchange(ctx, words, header.tag(ctx, call), low)
        header.agree(ctx, words, halves, call, lambda: spec.describe("reduce"))
        if inline:
            rows = words.rows()
            wire = [(ops.reduce_rows(buffers.inline_rows(rows, b), op), False, None, None) for b in layout.buckets]
    reduced = wire if ctx.size == 1 or inline else _all_reduce(ctx, wire, op)
    if dst is not None and ctx.strategy.global_rank != dst:
        return None
    return rebuild(tree, _results(ctx, layout, leaves, reduced, op), data)


def _local(ctx: Context, layout: Layout, leaves: Sequence[Any]) -> List[Reduced]:
    """One rank: the reduction of a single row (a copy, with the op's dtype rules)."""
    return [(buffers.pack(b, leaves, ctx.device, copy=True), False, None, None) for b in layout.buckets]


def _pack(ctx: Context, layout: Layout, leaves: Sequence[Any], op: str) -> List[Reduced]:
    """One wire buffer per bucket (a mean over a power-of-two group divided while packing)."""
    out: List[Reduced] = []
    for bucket in layout.buckets:
        divisor = ops.predivide(op, bucket.wire, ctx.size)
        slot = _pooled_single(ctx, bucket, leaves)
        if slot is not None:
            out.append((slot.buffer, divisor is not None, slot, bucket.take(leaves)[0]))
        else:
            out.append((buffers.pack(bucket, leaves, ctx.device, copy=True, divisor=divisor), divisor is not None,
                        None, None))
    return out


def _all_reduce(ctx: Context, wire: List[Reduced], op: str) -> List[Reduced]:
    """One primitive all_reduce per wire buffer (in place where the strategy allows); a pooled single tensor
    is copied into its buffer by the strategy's all_reduce_copy, which overlaps the copy with the reduction."""
    out: List[Reduced] = []
    primitive = ops.primitive_op(op)
    for buf, divided, slot, source in wire:
        if source is not None:
            result = ctx.strategy.flat_all_reduce_copy(buf, source, primitive, ctx.group, ctx.size if divided else None)
        else:
            result = ctx.strategy.flat_all_reduce(buf, primitive, ctx.group)
        out.append((result, divided, slot if result is buf else None, None))
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


def _results(ctx: Context, layout: Layout, leaves: Sequence[Any], reduced: List[Reduced], op: str) -> List[Any]:
    outs = list(leaves)
    for bucket, (buf, divided, slot, _) in zip(layout.buckets, reduced):
        flat = ops.finish(buf, op, bucket.result, ctx.size, divided=divided)
        if slot is not None and flat is slot.buffer:
            slot.commit()
            pieces: Sequence[Any] = slot.views
        else:
            pieces = buffers.split_flat(flat, bucket)
        outs = buffers.place_results(outs, bucket, pieces)
        if bucket.elsewhere(ctx.device):
            buffers.to_devices(outs, bucket.ids, bucket.devices, ctx.device)
    return outs
