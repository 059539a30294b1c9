"""Stage 3 of every collective: the leaves packed for the wire, and the buffers they are packed into.

Every call first takes its group's header row (``begin``: ``Words``, reused across calls). A reduction's
leaves are written straight into the row's payload when they fit there (the header exchange then carries the
data: one collective in all), else into one flat wire buffer per bucket; an all_gather's leaves become one byte
row (varying dims, fixed buckets, varying tensors, pickled objects), written into the payload when it fits; a
broadcast's object becomes a message (its pickle with the tensors left out, then the tensors' bytes). Each rank's
row length travels in its header in UNIT-byte units (``units``; ValueError beyond what one call carries).
"""
from __future__ import annotations

import io
import pickle
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fabriclite.collectives.buffers import (CAPACITY, POOL_MIN_BYTES, SKELETON_AT, UNIT, Header, Message, Packed, Row, Slot,
                                            Words, pool_of)
from fabriclite.collectives.object_pickle import dumps
from fabriclite.collectives.plans import MAX_SIZE, Bucket, GatherPlan, Layout, Plan, align
from fabriclite.collectives.state import Context
from fabriclite.collectives.structure import Values

_item = Tensor.item
#: wire dtypes numpy can write directly
_NUMPY = {torch.float16: "float16", torch.float32: "float32", torch.float64: "float64", torch.int8: "int8",
          torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64", torch.bool: "bool",
          torch.complex64: "complex64", torch.complex128: "complex128"}
_CPU = torch.device("cpu")


def units(nbytes: int) -> int:
    """``nbytes`` in UNIT-byte units, rounded up; ValueError beyond what a header word carries."""
    n = -(-nbytes // UNIT)
    if n > MAX_SIZE:
        raise ValueError(f"{nbytes} bytes from one rank in one call is more than a collective carries "
                         f"({MAX_SIZE * UNIT} bytes); split the data over several calls.")
    return n


def row_units(words: Words, length: int, fixed: bool, inline: bool) -> Optional[int]:
    """The low half of this rank's header for a row of ``length`` bytes: None when it fills a width-1 header;
    0 when the row is ``fixed`` (the same length on every rank), rides inline and would fit a width-1 header,
    so that the group goes back to that cheapest form (``header.agree`` sizes the next width from it); else
    its length in UNIT-byte units."""
    if inline and words.width == 1:
        return None
    if inline and fixed and length <= CAPACITY:
        return 0
    return units(length)


def begin(ctx: Context) -> Words:
    """This group's header buffer for the next call, cleared (the all_reduce form needs every other rank's
    word zero): pack this rank's inline payload into it, then ``header.agree``."""
    state = ctx.header
    if state is None:
        key = (ctx.group, ctx.device)
        state = ctx.state.headers.get(key)
        if state is None:
            state = ctx.state.headers[key] = Header(ctx.size, ctx.index, ctx.device)
        ctx.header = state
    words = state.buffers.get(state.width)
    if words is None:
        words = state.buffers[state.width] = Words(state, state.width)
    if words.width == 1:
        if words.numpy is not None:
            words.numpy[:] = 0
        else:
            words.gathered.zero_()
    return words


# ---------------------------------------------------------------------------------------------- reductions
def pack_reduce(ctx: Context, plan: Plan, leaves: Sequence[Any], header: bool,
                stacked: Optional[Values] = None) -> Packed:
    """A reduction's leaves into the payload of the group's header row (``words``, when ``header``) when they
    fit, else one wire buffer per bucket (a mean over a power-of-two group divided while packing; a large
    single tensor left for the wire to copy into a reused buffer; ``inplace``: the caller's contiguous tensor
    is its own wire buffer). ``stacked``: every leaf's value, from ``SpecCache.find`` (one bucket of 0-d
    tensors; ``structure.read_uniform``: a list of Python numbers or a tensor), written in one assignment or
    copy instead of leaf by leaf."""
    words = begin(ctx) if header else None
    used = plan.layout.used
    inline = words is not None and used <= words.room
    low = None if words is None else row_units(words, used, True, inline)
    if inline:
        assert words is not None
        write_inline(plan.buckets, leaves, words.payload, words.payload_np, ctx.device, plan.divisors, stacked)
        return Packed(words, True, [], low)
    out: List[Tuple[Tensor, bool, Optional[Slot], Optional[Tensor]]] = []
    for k, bucket in enumerate(plan.buckets):
        divisor = plan.divisors[k]
        direct = leaves[bucket.ids[0]] if plan.inplace and plan.direct[k] else None
        if direct is not None and direct.is_contiguous():  # a mean divided in place by the wire, chunk by chunk
            split = divisor is not None and ctx.size > 1  # while the chunks before are reduced
            out.append((direct, split, None, direct if split else None))
        elif ctx.size == 1:  # one rank: the reduction of one row is a copy
            out.append((pack(bucket, leaves, ctx.device, copy=True, stacked=stacked), False, None, None))
        elif plan.inplace or not _large_single(bucket, leaves):
            out.append((pack(bucket, leaves, ctx.device, copy=True, divisor=divisor, stacked=stacked),
                        divisor is not None, None, None))
        else:  # a reused wire buffer (warm memory: no page faults); the wire copies the tensor into it
            shape = bucket.shapes[0]
            slot = pool_of(bucket, "wire", lambda b: (b.view(shape),)).acquire((bucket.numel,), bucket.wire,
                                                                               ctx.device)
            out.append((slot.buffer, divisor is not None, slot, leaves[bucket.ids[0]]))
    return Packed(words, False, out, low)


def _large_single(bucket: Bucket, leaves: Sequence[Any]) -> bool:
    return (bucket.mode == "single" and bucket.nbytes >= POOL_MIN_BYTES and bucket.wire == bucket.result
            and leaves[bucket.ids[0]].dtype == bucket.wire)


def pack(bucket: Bucket, leaves: Sequence[Any], device: torch.device, copy: bool,
         divisor: Optional[int] = None, stacked: Optional[Values] = None) -> Tensor:
    """The bucket's leaves (canonical order) as one flat ``bucket.wire`` tensor on ``device``, divided by
    ``divisor`` when given. ``copy=False`` may return a view of the caller's single tensor (never to be
    written to). ``stacked``: every leaf's value in the caller's order (a list of Python numbers, or a new
    tensor, ours to change), for a bucket that holds every leaf."""
    wire, mode = bucket.wire, bucket.mode
    if stacked is not None and bucket.whole:
        if isinstance(stacked, list):
            buf = torch.tensor(stacked, dtype=wire)
            buf = buf if device == _CPU else buf.to(device)
        else:
            buf = stacked.to(device=device, dtype=wire)
        if bucket.perm is not None:
            buf = buf.index_select(0, bucket.index[device][0])
        return buf.div_(divisor) if divisor is not None else buf
    items = leaves if bucket.take is None else bucket.take(leaves)
    if mode == "single":
        flat = items[0].reshape(-1)
        if divisor is not None:
            return torch.div(flat, divisor).to(device=device, dtype=wire)
        if flat.dtype != wire or flat.device != device:
            return flat.to(device=device, dtype=wire)
        return flat.clone() if copy else flat
    if mode == "numbers":
        buf = torch.tensor(items, dtype=wire, device=device)
    elif mode == "scalars":
        buf = torch.tensor(list(map(_item, items)), dtype=wire)
        buf = buf if device == _CPU else buf.to(device)
    else:
        buf = torch.cat([_flat(x, wire, device) for x in items])
    if bucket.perm is not None:  # packed in the caller's order: to the canonical order on the wire
        buf = buf.index_select(0, bucket.index[device][0])
    return buf.div_(divisor) if divisor is not None else buf


def write_inline(buckets: Sequence[Bucket], leaves: Sequence[Any], dest: Tensor, dest_np: Any,
                 device: torch.device, divisors: Optional[Sequence[Optional[int]]] = None,
                 stacked: Optional[Values] = None) -> None:
    """Pack ``buckets`` at their offsets into ``dest`` (uint8; ``dest_np``: the same memory as a numpy
    array, or None): 0-d buckets go straight from Python values into the bytes (no tensor per call), each
    divided by its ``divisors`` entry when given (a mean over a power-of-two group; exact); or, given
    ``stacked`` (every leaf's value in the caller's order: Python numbers, written the same way by one numpy
    assignment, or a tensor), a bucket holding every leaf is written from it at once (permuted to the
    canonical order on the way)."""
    for k, bucket in enumerate(buckets):
        divisor = divisors[k] if divisors is not None else None
        whole = stacked is not None and bucket.whole
        if whole and not isinstance(stacked, list):
            assert stacked is not None
            _write_stacked(bucket, stacked, dest, divisor)
            continue
        region = _region(bucket, dest_np) if dest_np is not None and bucket.scalar else None
        if region is None:
            part = as_bytes(pack(bucket, leaves, device, copy=False, divisor=divisor,
                                 stacked=stacked if whole else None))
            dest[bucket.offset:bucket.offset + part.numel()].copy_(part)
            continue
        if whole:
            values: Any = stacked
        else:
            items = leaves if bucket.take is None else bucket.take(leaves)
            if len(items) == 1:
                value = items[0].item() if bucket.mode == "scalars" else items[0]
                region[0] = value / divisor if divisor is not None else value
                continue
            values = list(map(_item, items)) if bucket.mode == "scalars" else items
        if bucket.perm is None:
            region[:] = values
        else:
            region[bucket.inverse_np] = values
        if divisor is not None:
            region /= divisor


def _write_stacked(bucket: Bucket, stacked: Tensor, dest: Tensor, divisor: Optional[int]) -> None:
    """``stacked`` (the bucket's leaves in the caller's order) into the bucket's typed region of ``dest``."""
    cached = bucket.cache.get("inline tensor")
    if cached is None or cached[0] is not dest:
        region = dest[bucket.offset:bucket.offset + bucket.nbytes].view(bucket.wire)
        cached = bucket.cache["inline tensor"] = (dest, region)
    region = cached[1]
    if stacked.device != region.device:
        stacked = stacked.to(region.device)
    if bucket.perm is None:
        region.copy_(stacked)
    elif stacked.dtype == region.dtype:
        torch.index_select(stacked, 0, bucket.index[region.device][0], out=region)
    else:
        region.copy_(stacked.index_select(0, bucket.index[region.device][0]))
    if divisor is not None:
        region.div_(divisor)


def _region(bucket: Bucket, dest_np: Any) -> Any:
    """The bucket's part of the numpy payload ``dest_np``, typed (None for a dtype numpy cannot write);
    made once per bucket and payload."""
    cached = bucket.cache.get("inline region")
    if cached is None or cached[0] is not dest_np:
        np_dtype = _NUMPY.get(bucket.wire)
        region = dest_np[bucket.offset:bucket.offset + bucket.nbytes].view(np_dtype) if np_dtype else None
        cached = bucket.cache["inline region"] = (dest_np, region)
    return cached[1]


def _flat(x: Any, wire: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(x, Tensor):
        return x.reshape(-1).to(device=device, dtype=wire)
    return torch.tensor([x], dtype=wire, device=device)


def as_bytes(t: Tensor) -> Tensor:
    """``t``'s bytes as a flat uint8 tensor (a view when ``t`` is contiguous)."""
    return t.reshape(-1).view(torch.uint8)


def _bytes_tensor(raw: bytes, device: torch.device) -> Tensor:
    if not raw:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def _write(dest: Tensor, parts: Sequence[Tuple[int, Tensor]]) -> None:
    for offset, part in parts:
        dest[offset:offset + part.numel()].copy_(part)


# ---------------------------------------------------------------------------------------------- gathers
def pack_row(ctx: Context, plan: GatherPlan, leaves: Sequence[Any], header: bool,
             stacked: Optional[Values] = None) -> Row:
    """This rank's row (raises what packing or pickling raises, or ValueError for a row too long for one
    call): written straight into the payload of the group's header row (``words``, when ``header``) when it
    fits there, else as parts. ``stacked``: as for ``pack_reduce``."""
    words = begin(ctx) if header else None
    layout = plan.layout
    if words is not None and words.width == 1:  # 4 bytes: only a fixed row, the same length on every rank
        if layout.fixed_only and layout.used <= words.room:
            write_inline(layout.buckets, leaves, words.payload, words.payload_np, ctx.device, None, stacked)
            return Row(words, layout.used, None, True, [])
    extra = []
    if layout.nvar:
        var = _var_words(layout, leaves)
        extra.append((0, as_bytes(torch.tensor(var, dtype=torch.int64, device=ctx.device))))
    offset = layout.fixed_end
    for i in layout.var_ids:
        raw = as_bytes(leaves[i].to(ctx.device))
        extra.append((offset, raw))
        offset = align(offset + raw.numel())
    length = offset
    if layout.object_ids:  # self-delimiting: the padding after it is ignored when loading
        blob = dumps([leaves[i] for i in layout.object_ids])  # tensors inside by value, out of band
        extra.append((offset, _bytes_tensor(blob, ctx.device)))
        length = offset + len(blob)
    low = units(length)
    if words is not None and words.width > 1 and length <= words.room:
        write_inline(layout.buckets, leaves, words.payload, words.payload_np, ctx.device, None, stacked)
        _write(words.payload, extra)
        return Row(words, length, row_units(words, length, layout.fixed_only, True), True, [])
    parts = [(b.offset, as_bytes(pack(b, leaves, ctx.device, copy=False, stacked=stacked)))
             for b in layout.buckets] + extra
    buckets, slot = layout.buckets, None
    if ctx.size > 1 and layout.fixed_only and len(buckets) == 1 and buckets[0].mode == "single" \
            and low * UNIT == buckets[0].nbytes >= POOL_MIN_BYTES:  # gathered into a reused buffer
        bucket, size, shape = buckets[0], ctx.size, buckets[0].shapes[0]
        pool = pool_of(bucket, f"gathered{size}", lambda b: (b.view(size, *shape),))
        slot = pool.acquire((size, bucket.numel), bucket.wire, ctx.device)
    return Row(words, length, low, False, parts, slot)


def _var_words(layout: Layout, leaves: Sequence[Any]) -> List[int]:
    shapes = [leaves[i].shape for i in layout.var_ids]
    if layout.var_dims == "first":
        return [s[0] for s in shapes]
    return [d for s in shapes for d in s]


# ---------------------------------------------------------------------------------------------- broadcasts
class _Pickler(pickle.Pickler):
    """Pickles everything but tensors; each tensor becomes a reference (index, dtype, shape)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: List[Tensor] = []

    def persistent_id(self, obj: Any) -> Optional[Tuple[int, str, Tuple[int, ...]]]:
        if isinstance(obj, Tensor):
            self.tensors.append(obj)
            return (len(self.tensors) - 1, str(obj.dtype).replace("torch.", ""), tuple(obj.shape))
        return None


def pack_message(ctx: Context, obj: Any, is_src: bool, header: bool) -> Message:
    """``src``'s message (other ranks: an empty one), written into the payload of the group's header row
    (``words``, when ``header``) when it fits; without a header, only the skeleton and the tensors' bytes."""
    words = begin(ctx) if header else None
    skeleton, parts, nbytes = b"", [], 0
    if is_src:
        out = io.BytesIO()
        pickler = _Pickler(out)
        pickler.dump(obj)
        skeleton = out.getvalue()
        for t in pickler.tensors:
            raw = as_bytes(t.detach().to(ctx.device))
            parts.append((nbytes, raw))
            nbytes = align(nbytes + raw.numel())
    if words is None or not is_src:
        return Message(words, skeleton, parts, nbytes, [], 0, 0, False)
    data_at = align(SKELETON_AT + len(skeleton))
    head = as_bytes(torch.tensor([len(skeleton)], dtype=torch.int64, device=ctx.device))
    message = [(0, head), (SKELETON_AT, _bytes_tensor(skeleton, ctx.device))]
    message += [(data_at + off, raw) for off, raw in parts]
    length = data_at + nbytes
    low = units(length)
    inline = words.width > 1 and length <= words.room
    if inline:
        _write(words.payload, message)
    return Message(words, skeleton, parts, nbytes, message, length, low, inline)
