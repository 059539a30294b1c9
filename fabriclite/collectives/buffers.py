"""Leaves into flat buffers and back: one typed buffer per bucket, byte rows for whole collections, and the
split of results into per-leaf tensors (views of one buffer, detached copies when the buffer is large)."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fabriclite.collectives.pool import POOL_MIN_LEAVES, pool_of
from fabriclite.collectives.spec import Bucket

_item = Tensor.item
#: wire dtypes numpy can write directly
_NUMPY = {torch.float16: "float16", torch.float32: "float32", torch.float64: "float64", torch.int8: "int8",
          torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64", torch.bool: "bool",
          torch.complex64: "complex64", torch.complex128: "complex128"}
#: results of a bucket larger than this are copied out leaf by leaf, so one kept leaf does not pin the bucket
DETACH_BYTES = 1 << 20
_CPU = torch.device("cpu")


def pack(bucket: Bucket, leaves: Sequence[Any], device: torch.device, copy: bool,
         divisor: Optional[int] = None) -> Tensor:
    """The bucket's leaves (canonical order) as one flat ``bucket.wire`` tensor on ``device``, divided by
    ``divisor`` when given. ``copy=False`` may return a view of the caller's single tensor (never to be
    written to)."""
    items = bucket.take(leaves)
    wire, mode = bucket.wire, bucket.mode
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
        buf = buf.index_select(0, bucket.index(device)[0])
    return buf.div_(divisor) if divisor is not None else buf


def write_inline(buckets: Sequence[Bucket], leaves: Sequence[Any], dest: Tensor, dest_np: Any,
                 device: torch.device, divisors: Optional[Sequence[Optional[int]]] = None) -> None:
    """Pack ``buckets`` at their offsets into ``dest`` (uint8; ``dest_np``: the same memory as a numpy
    array, or None): 0-d buckets go straight from Python values into the bytes (no tensor per call), each
    divided by its ``divisors`` entry when given (a mean over a power-of-two group; exact)."""
    for k, bucket in enumerate(buckets):
        divisor = divisors[k] if divisors is not None else None
        region = _region(bucket, dest_np) if dest_np is not None and bucket.scalar else None
        if region is None:
            part = as_bytes(pack(bucket, leaves, device, copy=False, divisor=divisor))
            dest[bucket.offset:bucket.offset + part.numel()].copy_(part)
            continue
        items = bucket.take(leaves)
        if len(items) == 1:
            value = items[0].item() if bucket.mode == "scalars" else items[0]
            region[0] = value / divisor if divisor is not None else value
            continue
        values = list(map(_item, items)) if bucket.mode == "scalars" else items
        if bucket.perm is None:
            region[:] = values
        else:
            region[bucket.inverse_np()] = values
        if divisor is not None:
            region /= divisor


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


def bucket_rows(rows: Tensor, bucket: Bucket) -> Tensor:
    """``(size, bucket.numel)`` typed view of the bucket's bytes in every row of ``rows`` (uint8)."""
    return rows[:, bucket.offset:bucket.offset + bucket.nbytes].view(bucket.wire)


def inline_rows(rows: Tensor, bucket: Bucket) -> Tensor:
    """``bucket_rows`` of the header's reused payload ``rows``, made once per bucket and rows tensor."""
    cached = bucket.cache.get("inline rows")
    if cached is None or cached[0] is not rows:
        cached = bucket.cache["inline rows"] = (rows, bucket_rows(rows, bucket))
    return cached[1]


def write(dest: Tensor, parts: Sequence[Tuple[int, Tensor]]) -> None:
    for offset, part in parts:
        dest[offset:offset + part.numel()].copy_(part)


def assemble(parts: Sequence[Tuple[int, Tensor]], length: int, device: torch.device) -> Tensor:
    """One uint8 row of ``length`` bytes holding ``parts`` ((offset, uint8 tensor)); the part itself when
    it is the whole row (no copy)."""
    if len(parts) == 1 and parts[0][0] == 0 and parts[0][1].numel() == length and parts[0][1].device == device:
        return parts[0][1]
    row = torch.empty(length, dtype=torch.uint8, device=device)
    write(row, parts)
    return row


# ---------------------------------------------------------------------------------------------- results
def split_flat(flat: Tensor, bucket: Bucket) -> Sequence[Tensor]:
    """A reduced bucket ``(numel,)`` as one tensor per leaf, shaped like the leaves: in the caller's order
    for a whole 0-d bucket, else in the bucket's (canonical) order."""
    if bucket.scalar:
        if bucket.perm is not None:
            flat = flat.index_select(0, bucket.index(flat.device)[1])
        return pool_of(bucket, "flat").views(flat) if len(bucket.ids) >= POOL_MIN_LEAVES else flat.unbind()
    if bucket.mode == "single":
        return (flat.view(bucket.shapes[0]),)
    pieces = [p.view(s) for p, s in zip(flat.split(bucket.numels), bucket.shapes)]
    if flat.numel() * flat.element_size() > DETACH_BYTES:
        pieces = [p.clone() for p in pieces]
    return pieces


def split_stacked(region: Tensor, bucket: Bucket) -> Sequence[Tensor]:
    """A gathered bucket ``(size, numel)`` as one contiguous ``(size, *shape)`` tensor per leaf."""
    size = region.shape[0]
    if bucket.scalar:
        if bucket.perm is not None:
            region = region.index_select(1, bucket.index(region.device)[1])
        columns = region.t().contiguous()
        return pool_of(bucket, "stacked").views(columns) if len(bucket.ids) >= POOL_MIN_LEAVES else columns.unbind()
    if bucket.mode == "single":
        return (region.reshape(size, *bucket.shapes[0]).contiguous(),)
    out, start = [], 0
    for numel, shape in zip(bucket.numels, bucket.shapes):
        out.append(region[:, start:start + numel].reshape(size, *shape).contiguous())
        start += numel
    return out


def place(outs: List[Any], ids: Sequence[int], pieces: Sequence[Any]) -> None:
    """``outs[ids[k]] = pieces[k]``."""
    for i, piece in zip(ids, pieces):
        outs[i] = piece


def to_devices(outs: List[Any], ids: Sequence[int], devices: Sequence[Optional[torch.device]],
               here: torch.device) -> None:
    """Move results whose leaf lived on another device than ``here`` back to that device."""
    for i, device in zip(ids, devices):
        if device is not None and device != here:
            outs[i] = outs[i].to(device)


def place_results(outs: List[Any], bucket: Bucket, pieces: Sequence[Any]) -> List[Any]:
    """``outs`` with the bucket's results in: the pieces themselves when they are every leaf in the caller's
    order (whole 0-d buckets), else placed by index."""
    if bucket.whole and bucket.scalar:
        return list(pieces)
    place(outs, bucket.ids, pieces)
    return outs
