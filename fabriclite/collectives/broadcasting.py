"""broadcast of any picklable object: the object is pickled with its tensors left out (a skeleton), the
tensors travel as raw bytes and are rebuilt on each receiver's device.

The header exchange checks that every rank calls broadcast with the same ``src`` and carries the skeleton
(and the tensors, when small) from ``src``; larger parts follow in primitive broadcasts.
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

_SKELETON_INLINE, _DATA_INLINE = 1, 2


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
    with torch.no_grad():
        try:
            src_index = ctx.member_index(src, f"src={src}")
            skeleton, tensors = _skeleton(obj) if ctx.index == src_index else (b"", [])
            parts, nbytes = _data_parts(tensors, ctx.device)
            if not check:
                return _unchecked(ctx, obj, src, skeleton, parts, nbytes)
            flags, inline_parts = _inline(ctx, skeleton, parts, nbytes)
        except Exception as err:  # on one rank only, maybe: every rank must hear of it
            if not check:
                raise
            header.fail(ctx, header.BROADCAST, err, root=src)
        words = header.call_words(header.BROADCAST, root=src, nbytes=nbytes, inline=flags, aux=len(skeleton))
        gathered = header.exchange(ctx, words, inline_parts)
        metas = header.agree(ctx, gathered)
        if ctx.index == src_index:
            _send_rest(ctx, src, skeleton, parts, nbytes, flags)
            return obj
        return _receive(ctx, src, gathered[src_index], metas[src_index])


def _inline(ctx: Context, skeleton: bytes, parts: List[Tuple[int, Tensor]],
            nbytes: int) -> Tuple[int, List[Tuple[int, Tensor]]]:
    """The header flags and inline parts: the skeleton when it fits, and the tensor bytes after it when
    they fit too."""
    cap = header.capacity(ctx.size)
    if len(skeleton) > cap:
        return 0, []
    inline_parts = [(0, header.bytes_tensor(skeleton, ctx.device))]
    data_at = align(len(skeleton))
    if data_at + nbytes > cap:
        return _SKELETON_INLINE, inline_parts
    return _SKELETON_INLINE | _DATA_INLINE, inline_parts + [(data_at + off, raw) for off, raw in parts]


def _send_rest(ctx: Context, src: int, skeleton: bytes, parts: List[Tuple[int, Tensor]], nbytes: int,
               flags: int) -> None:
    if not flags & _SKELETON_INLINE:
        ctx.strategy.broadcast(header.bytes_tensor(skeleton, ctx.device), src, ctx.group)
    if not flags & _DATA_INLINE and nbytes:
        ctx.strategy.broadcast(buffers.assemble(parts, nbytes, ctx.device), src, ctx.group)


def _receive(ctx: Context, src: int, src_header: Tensor, meta: List[int]) -> Any:
    flags, skeleton_len, nbytes = meta[header.W_INLINE], meta[header.W_AUX], meta[header.W_NBYTES]
    payload = src_header.view(torch.uint8)[header.META_BYTES:]
    if flags & _SKELETON_INLINE:
        skeleton = payload[:skeleton_len].cpu().numpy().tobytes()
    else:
        buf = ctx.strategy.broadcast(torch.empty(skeleton_len, dtype=torch.uint8, device=ctx.device), src, ctx.group)
        skeleton = buf.cpu().numpy().tobytes()
    if flags & _DATA_INLINE:
        start = align(skeleton_len)
        data = payload[start:start + nbytes].clone()
    elif nbytes:
        data = ctx.strategy.broadcast(torch.empty(nbytes, dtype=torch.uint8, device=ctx.device), src, ctx.group)
    else:
        data = torch.empty(0, dtype=torch.uint8, device=ctx.device)
    return _Unpickler(io.BytesIO(skeleton), data).load()


def _unchecked(ctx: Context, obj: Any, src: int, skeleton: bytes, parts: List[Tuple[int, Tensor]],
               nbytes: int) -> Any:
    """Without the header: the skeleton as an object broadcast, then the tensor bytes."""
    is_src = ctx.strategy.global_rank == src
    skeleton, nbytes = ctx.strategy.broadcast_object((skeleton, nbytes), src, ctx.group)
    if is_src:
        if nbytes:
            ctx.strategy.broadcast(buffers.assemble(parts, nbytes, ctx.device), src, ctx.group)
        return obj
    data = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
    if nbytes:
        data = ctx.strategy.broadcast(data, src, ctx.group)
    return _Unpickler(io.BytesIO(skeleton), data).load()
