"""all_reduce and reduce over nested collections: one header exchange (which carries the data itself when
it is at most 4 bytes, every rank then reducing every rank's copy), then one primitive all_reduce per bucket."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fabriclite.collectives import buffers, header, ops
from fabriclite.collectives.pool import POOL_MIN_BYTES, Slot, pool_of
from fabriclite.collectives.spec import Bucket, Layout
from fabriclite.collectives.state import Context
from fabriclite.collectives.tree import flatten, rebuild


#: a reduced wire buffer, whether a mean was already divided while packing, and the pool slot it is
Reduced = Tuple[Tensor, bool, Optional[Slot]]


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
        inline = checked and layout.used <= header.CAPACITY
        if inline:  # the data rides in the header word: one collective in all
            words = header.begin(ctx)
            buffers.write_inline(layout.buckets, leaves, words.payload, words.payload_np, ctx.device)
            wire: List[Reduced] = []
        else:  # packed before the header, so that a failure to pack is reported to every rank
            wire = _local(ctx, layout, leaves) if ctx.size == 1 else _pack(ctx, layout, leaves, op)
    except Exception as err:  # on one rank only, maybe: every rank must hear of it
        if not checked:
            raise
        header.fail(ctx, call, err)
    if checked:
        call = call._replace(digest=spec.digest("reduce"), fixed=layout.fixed_end)
        halves = header.exchange(ctx, words if inline else header.begin(ctx), header.tag(ctx, call),
                                 None if inline else 0)
        header.agree(ctx, halves, call, lambda: spec.describe("reduce"))
        if inline:
            rows = words.rows()
            wire = [(ops.reduce_rows(buffers.inline_rows(rows, b), op), False, None) for b in layout.buckets]
    reduced = wire if ctx.size == 1 or inline else _all_reduce(ctx, wire, op)
    if dst is not None and ctx.strategy.global_rank != dst:
        return None
    return rebuild(tree, _results(ctx, layout, leaves, reduced, op), data)


def _local(ctx: Context, layout: Layout, leaves: Sequence[Any]) -> List[Reduced]:
    """One rank: the reduction of a single row (a copy, with the op's dtype rules)."""
    return [(buffers.pack(b, leaves, ctx.device, copy=True), False, None) for b in layout.buckets]


def _pack(ctx: Context, layout: Layout, leaves: Sequence[Any], op: str) -> List[Reduced]:
    """One wire buffer per bucket (a mean over a power-of-two group divided while packing)."""
    out: List[Reduced] = []
    for bucket in layout.buckets:
        divisor = ops.predivide(op, bucket.wire, ctx.size)
        slot = _pooled_single(ctx, bucket, leaves, divisor)
        buf = slot.buffer if slot is not None else buffers.pack(bucket, leaves, ctx.device, copy=True, divisor=divisor)
        out.append((buf, divisor is not None, slot))
    return out


def _all_reduce(ctx: Context, wire: List[Reduced], op: str) -> List[Reduced]:
    """One primitive all_reduce per wire buffer (in place where the strategy allows)."""
    out: List[Reduced] = []
    for buf, divided, slot in wire:
        result = ctx.strategy.all_reduce(buf, ops.primitive_op(op), ctx.group)
        out.append((result, divided, slot if result is buf else None))
    return out


def _pooled_single(ctx: Context, bucket: Bucket, leaves: Sequence[Any], divisor: Optional[int]) -> Optional[Slot]:
    """A large single tensor packed into a reused wire buffer (warm memory: no page faults), or None."""
    if bucket.mode != "single" or bucket.nbytes < POOL_MIN_BYTES or bucket.wire != bucket.result:
        return None
    source = bucket.take(leaves)[0]
    if source.dtype != bucket.wire:
        return None
    shape = bucket.shapes[0]
    slot = pool_of(bucket, "wire", lambda b: (b.view(shape),)).acquire((bucket.numel,), bucket.wire, ctx.device)
    if divisor is not None:
        torch.div(source.reshape(-1), divisor, out=slot.buffer)
    else:
        slot.buffer.copy_(source.reshape(-1))
    return slot


def _results(ctx: Context, layout: Layout, leaves: Sequence[Any], reduced: List[Reduced], op: str) -> List[Any]:
    outs = list(leaves)
    for bucket, (buf, divided, slot) in zip(layout.buckets, reduced):
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
