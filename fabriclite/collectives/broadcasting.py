"""broadcast of any picklable object: the object is pickled with its tensors left out (a skeleton), the
tensors travel as raw bytes and are rebuilt on each receiver's device.

The header exchange checks that every rank calls broadcast with the same ``src`` and carries ``src``'s
message (skeleton and tensor bytes) when it fits, else its length; the message then follows in one
primitive broadcast.
"""
from __future__ import annotations

import io
import pickle
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from fabriclite.collectives import buffers, header
from fabriclite.collectives.spec import align
from fabriclite.collectives.state import Context

#: where the skeleton starts in a message (after its int64 length)
_SKELETON_AT = 16


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


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, data: Tensor) -> None:
        super().__init__(file)
        self.data = data
        self.offset = 0

    def persistent_load(self, pid: Tuple[int, str, Tuple[int, ...]]) -> Tensor:
        _, dtype_name, shape = pid
        dtype = getattr(torch, dtype_name)
        numel = 1
        for s in shape:
            numel *= s
        start, nbytes = self.offset, numel * dtype.itemsize
        self.offset = align(start + nbytes)
        out = self.data[start:start + nbytes].view(dtype).view(shape)
        if self.data.numel() > buffers.DETACH_BYTES and nbytes < self.data.numel():
            out = out.clone()  # one kept tensor must not pin the whole buffer
        return out


def _skeleton(obj: Any) -> Tuple[bytes, List[Tensor]]:
    out = io.BytesIO()
    pickler = _Pickler(out)
    pickler.dump(obj)
    return out.getvalue(), pickler.tensors


def _data_parts(tensors: List[Tensor], device: torch.device) -> Tuple[List[Tuple[int, Tensor]], int]:
    parts, offset = [], 0
    for t in tensors:
        raw = buffers.as_bytes(t.detach().to(device))
        parts.append((offset, raw))
        offset = align(offset + raw.numel())
    return parts, offset


def broadcast(ctx: Context, obj: Any, src: int, check: bool) -> Any:
    """See ``fabriclite.collectives.broadcast``."""
    if ctx.size == 1:
        ctx.member_index(src, f"src={src}")
        return obj
    call = header.Call(header.BROADCAST, root=src)
    with torch.no_grad():
        try:
            src_index = ctx.member_index(src, f"src={src}")
            is_src = ctx.index == src_index
            skeleton, tensors = _skeleton(obj) if is_src else (b"", [])
            parts, nbytes = _data_parts(tensors, ctx.device)
            if not check:
                return _unchecked(ctx, obj, src, skeleton, parts, nbytes)
            message, length = _message(skeleton, parts, nbytes, ctx.device) if is_src else ([], 0)
            size = header.units(length)
            words = header.begin(ctx)
            if is_src and words.width > 1 and words.fits(length):  # rides inline in the header
                buffers.write(words.payload, message)
        except Exception as err:  # on one rank only, maybe: every rank must hear of it
            if not check:
                raise
            header.fail(ctx, call, err)
        lows = header.agree(ctx, words, header.exchange(ctx, words, header.tag(ctx, call), size), call)
        length = lows[src_index] * header.UNIT
        if words.width > 1 and words.fits(length):
            if is_src:
                return obj
            data = words.rows()[src_index, :length].clone()
        elif is_src:
            ctx.strategy.flat_broadcast(buffers.assemble(message, length, ctx.device), src, ctx.group)
            return obj
        else:
            data = ctx.strategy.flat_broadcast(torch.empty(length, dtype=torch.uint8, device=ctx.device), src,
                                          ctx.group)
        skeleton_len = int(data[:8].view(torch.int64).item())
        start = _SKELETON_AT + skeleton_len
        skeleton = data[_SKELETON_AT:start].cpu().numpy().tobytes()
        return _Unpickler(io.BytesIO(skeleton), data[align(start):]).load()


def _message(skeleton: bytes, parts: List[Tuple[int, Tensor]], nbytes: int,
             device: torch.device) -> Tuple[List[Tuple[int, Tensor]], int]:
    """``src``'s message as (offset, uint8 tensor) parts and its length: the skeleton's length (int64), the
    skeleton at ``_SKELETON_AT``, the tensor bytes after it (aligned)."""
    data_at = align(_SKELETON_AT + len(skeleton))
    head = buffers.as_bytes(torch.tensor([len(skeleton)], dtype=torch.int64, device=device))
    message = [(0, head), (_SKELETON_AT, header.bytes_tensor(skeleton, device))]
    return message + [(data_at + off, raw) for off, raw in parts], data_at + nbytes


def _unchecked(ctx: Context, obj: Any, src: int, skeleton: bytes, parts: List[Tuple[int, Tensor]],
               nbytes: int) -> Any:
    """Without the header: the skeleton as an object broadcast, then the tensor bytes."""
    is_src = ctx.strategy.global_rank == src
    skeleton, nbytes = ctx.strategy.broadcast_object((skeleton, nbytes), src, ctx.group)
    if is_src:
        if nbytes:
            ctx.strategy.flat_broadcast(buffers.assemble(parts, nbytes, ctx.device), src, ctx.group)
        return obj
    data = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    if nbytes:
        data = ctx.strategy.flat_broadcast(data, src, ctx.group)
    return _Unpickler(io.BytesIO(skeleton), data).load()
