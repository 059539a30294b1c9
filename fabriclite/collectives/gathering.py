"""all_gather and gather over nested collections, as the same pipeline as a reduction:

    flatten -> plan (cached: Spec.gather_layout) -> pack (build_row) -> agree -> wire -> unpack (decode) -> rebuild

Each rank lays its collection out as one byte row: the varying dims (int64 words), the fixed buckets (same
place on every rank), the tensors whose shapes vary, the pickled non-tensor leaves. Rows that fit the
group's header ride inline in the header exchange (one collective in all); longer ones follow in one
primitive all_gather of rows padded to the longest (each rank's length travels in its header).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fabriclite.collectives import buffers, header
from fabriclite.collectives.autograd import attach_gather_grads
from fabriclite.collectives.pool import POOL_MIN_BYTES, Slot, pool_of
from fabriclite.collectives.spec import Bucket, Layout, Spec, align
from fabriclite.collectives.state import Context
from fabriclite.collectives.tree import flatten, rebuild

_HINTS = {"cat": " (with cat=True, dim 0 may differ)",
          "stack": " (pass cat=True to concatenate tensors whose dim 0 differs)"}


@dataclass
class Row:
    """This rank's row: its ``length`` and either ``inline`` (written into the header's payload) or
    ``parts`` ((byte offset, uint8 tensor)) to assemble."""

    parts: List[Tuple[int, Tensor]] = field(default_factory=list)
    length: int = 0
    inline: bool = False


@dataclass
class Gathered:
    """Every rank's row (``rows``: ``(size, L)`` uint8; ``inline``: they are the header's reused payload
    rows); or, for one large tensor, the pool ``slot`` it was gathered into."""

    rows: Optional[Tensor]
    slot: Optional[Slot] = None
    inline: bool = False


def all_gather(ctx: Context, data: Any, sync_grads: bool, cat: bool, check: bool) -> Any:
    """See ``fabriclite.collectives.all_gather``."""
    mode = "cat" if cat else "stack"
    call = header.Call(header.ALL_GATHER, flags=header.FLAG_CAT if cat else 0)
    with torch.no_grad():
        try:
            tree, leaves = flatten(data)
            spec = ctx.state.specs.get(tree, leaves)
            layout = spec.gather_layout(mode)
            words = header.begin(ctx) if ctx.size > 1 and (check or not layout.fixed_only) else None
            row = build_row(ctx, layout, leaves, words)
        except Exception as err:  # on one rank only, maybe: every rank must hear of it
            if ctx.size == 1 or not check:
                raise
            header.fail(ctx, call, err)
        lows = agree(ctx, spec, layout, row, words, call, mode)
        got = wire(ctx, layout, row, words, lows)
        outs, shapes = decode(ctx, spec, layout, leaves, got)
    if sync_grads and torch.is_grad_enabled():
        outs = attach_gather_grads(ctx, spec, layout, leaves, outs, shapes)
    if ctx.single_device:  # Lightning's contract for one process: no stacking dim
        for bucket in layout.buckets:
            for i in bucket.ids:
                outs[i] = outs[i][0]
    return rebuild(tree, outs, data)


def gather(ctx: Context, data: Any, dst: int) -> Optional[List[Any]]:
    """See ``fabriclite.collectives.gather``."""
    call = header.Call(header.GATHER, root=dst)
    with torch.no_grad():
        try:
            ctx.member_index(dst, f"dst={dst}")
            tree, leaves = flatten(data)
            spec = ctx.state.specs.get(tree, leaves)
            layout = spec.gather_layout("gather")
            words = header.begin(ctx) if ctx.size > 1 else None
            row = build_row(ctx, layout, leaves, words)
        except Exception as err:
            if ctx.size == 1:
                raise
            header.fail(ctx, call, err)
        got = wire(ctx, layout, row, words, agree(ctx, spec, layout, row, words, call, "gather"))
        if ctx.strategy.global_rank != dst:
            return None
        per_rank = [_decode_var(spec, layout, got, r) for r in range(ctx.size)]
    out = []
    for tensors, objects in per_rank:
        rank_leaves = list(leaves)
        buffers.place(rank_leaves, layout.var_ids, [t.clone() for t in tensors])
        buffers.place(rank_leaves, layout.object_ids, objects)
        out.append(rebuild(tree, rank_leaves, data))
    return out


# ---------------------------------------------------------------------------------------------- rows
def build_row(ctx: Context, layout: Layout, leaves: Sequence[Any], words: Optional[header.Words]) -> Row:
    """This rank's row (raises what packing or pickling raises, or ValueError for a row too long for one
    call): written straight into the payload of the header ``words`` when it fits there, else as parts."""
    row = Row()
    if words is not None and words.width == 1:  # 4 bytes: only a fixed row, the same length on every rank
        if layout.fixed_only and words.fits(layout.used):
            buffers.write_inline(layout.buckets, leaves, words.payload, words.payload_np, ctx.device)
            row.length, row.inline = layout.used, True
            return row
    extra = []
    if layout.nvar:
        var = _var_words(layout, leaves)
        extra.append((0, buffers.as_bytes(torch.tensor(var, dtype=torch.int64, device=ctx.device))))
    offset = layout.fixed_end
    for i in layout.var_ids:
        raw = buffers.as_bytes(leaves[i].to(ctx.device))
        extra.append((offset, raw))
        offset = align(offset + raw.numel())
    row.length = offset
    if layout.object_ids:  # self-delimiting: the padding after it is ignored when loading
        blob = pickle.dumps([leaves[i] for i in layout.object_ids], protocol=pickle.HIGHEST_PROTOCOL)
        extra.append((offset, header.bytes_tensor(blob, ctx.device)))
        row.length = offset + len(blob)
    header.units(row.length)
    if words is not None and words.width > 1 and words.fits(row.length):
        buffers.write_inline(layout.buckets, leaves, words.payload, words.payload_np, ctx.device)
        buffers.write(words.payload, extra)
        row.inline = True
        return row
    row.parts = [(b.offset, buffers.as_bytes(buffers.pack(b, leaves, ctx.device, copy=False)))
                 for b in layout.buckets] + extra
    return row


def _var_words(layout: Layout, leaves: Sequence[Any]) -> List[int]:
    shapes = [leaves[i].shape for i in layout.var_ids]
    if layout.var_dims == "first":
        return [s[0] for s in shapes]
    return [d for s in shapes for d in s]


def agree(ctx: Context, spec: Spec, layout: Layout, row: Row, words: Optional[header.Words], call: header.Call,
          mode: str) -> Optional[List[int]]:
    """The header exchange (``words``; None: no header, no agreement): every rank's row length in
    header.UNIT units, and every rank's row itself when it fits. Raises CollectiveMismatchError on every
    rank for a disagreement."""
    if words is None:
        return None
    call = call._replace(digest=spec.digest(mode), fixed=layout.fixed_end)
    low = None if row.inline and words.width == 1 else header.units(row.length)
    halves = header.exchange(ctx, words, header.tag(ctx, call), low)
    return header.agree(ctx, words, halves, call, lambda: spec.describe(mode), _HINTS.get(mode, ""))


def wire(ctx: Context, layout: Layout, row: Row, words: Optional[header.Words],
         lows: Optional[List[int]]) -> Gathered:
    """Every rank's row: the header's rows when every row rode inline, else one primitive all_gather of rows
    padded to the longest (``lows``: every rank's length, from ``agree``)."""
    if ctx.size == 1:
        return Gathered(buffers.assemble(row.parts, align(row.length), ctx.device).view(1, -1))
    if words is None or lows is None:
        return _gather_rows(ctx, layout, row, align(row.length))
    if words.width == 1 and row.inline:  # a fixed row: inline on every rank alike
        return Gathered(words.rows(), inline=True)
    longest = max(lows) * header.UNIT
    if words.width > 1 and words.fits(longest):
        return Gathered(words.rows(), inline=True)
    if row.inline:  # another rank's row did not fit: send this one again, from the header's payload
        row.parts = [(0, words.payload[:row.length])]
    return _gather_rows(ctx, layout, row, longest)


def _gather_rows(ctx: Context, layout: Layout, row: Row, length: int) -> Gathered:
    """The primitive all_gather of every rank's row padded to ``length``; one large tensor goes into a
    reused output buffer (warm memory, no page faults)."""
    mine = buffers.assemble(row.parts, length, ctx.device)
    buckets = layout.buckets
    if layout.fixed_only and len(buckets) == 1 and buckets[0].mode == "single" and length == buckets[0].nbytes \
            and buckets[0].nbytes >= POOL_MIN_BYTES:
        bucket, size = buckets[0], ctx.size
        shape = bucket.shapes[0]
        pool = pool_of(bucket, f"gathered{size}", lambda b: (b.view(size, *shape),))
        slot = pool.acquire((size, bucket.numel), bucket.wire, ctx.device)
        ctx.strategy.flat_all_gather_into(slot.buffer.view(torch.uint8).view(size, length), mine, ctx.group)
        slot.commit()
        return Gathered(None, slot)
    return Gathered(ctx.strategy.flat_all_gather(mine, ctx.group))


# ---------------------------------------------------------------------------------------------- decoding
def decode(ctx: Context, spec: Spec, layout: Layout, leaves: Sequence[Any],
           got: Gathered) -> Tuple[List[Any], List[List[Tuple[int, ...]]]]:
    """Per-leaf results in the caller's order: stacked ``(size, *shape)`` for fixed leaves, concatenated for
    var tensors, lists for objects; plus each var tensor's per-rank shapes."""
    outs = list(leaves)
    if got.slot is not None:
        bucket = layout.buckets[0]
        buffers.place(outs, bucket.ids, got.slot.views)
        if bucket.elsewhere(ctx.device):
            buffers.to_devices(outs, bucket.ids, bucket.devices, ctx.device)
        return outs, []
    assert got.rows is not None
    for bucket in layout.buckets:
        outs = buffers.place_results(outs, bucket, buffers.split_stacked(_bucket_rows(got, bucket), bucket))
        if bucket.elsewhere(ctx.device):
            buffers.to_devices(outs, bucket.ids, bucket.devices, ctx.device)
    shapes: List[List[Tuple[int, ...]]] = [[] for _ in layout.var_ids]
    if layout.fixed_only:
        return outs, shapes
    per_rank = [_decode_var(spec, layout, got, r) for r in range(got.rows.shape[0])]
    for k, i in enumerate(layout.var_ids):
        pieces = [tensors[k] for tensors, _ in per_rank]
        shapes[k] = [tuple(p.shape) for p in pieces]
        device = spec.leaves[i].device
        outs[i] = torch.cat(pieces).to(device if device is not None else ctx.device)
    for k, i in enumerate(layout.object_ids):
        outs[i] = [objects[k] for _, objects in per_rank]
    return outs, shapes


def _bucket_rows(got: Gathered, bucket: Bucket) -> Tensor:
    """``(size, numel)`` typed view of the bucket in every row."""
    assert got.rows is not None
    return buffers.inline_rows(got.rows, bucket) if got.inline else buffers.bucket_rows(got.rows, bucket)


def _decode_var(spec: Spec, layout: Layout, got: Gathered, r: int) -> Tuple[List[Tensor], List[Any]]:
    assert got.rows is not None
    row = got.rows[r]
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
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * leaf.dtype.itemsize
        tensors.append(row[offset:offset + nbytes].view(leaf.dtype).view(shape))
        offset = align(offset + nbytes)
    objects: List[Any] = []
    if layout.object_ids:
        objects = pickle.loads(row[offset:].cpu().numpy().tobytes())
    return tensors, objects
