"""Reduce operations: names, which dtypes they accept, the dtype each leaf travels and comes back in, and the
reduction of gathered rows on this rank; the bitwise emulation and op checks the strategies share."""
from __future__ import annotations

import functools
from typing import Any, Callable, Collection, Dict, Optional, Tuple

import torch
from torch import Tensor


#: accepted spellings (case-insensitive) -> canonical name
_ALIASES: Dict[str, str] = {
    "sum": "sum", "mean": "mean", "avg": "mean", "min": "min", "max": "max", "prod": "prod", "product": "prod",
    "band": "band", "bor": "bor", "bxor": "bxor",
}
#: canonical name -> header code (0 is "no op")
OP_CODES: Dict[str, int] = {"sum": 1, "mean": 2, "min": 3, "max": 4, "prod": 5, "band": 6, "bor": 7, "bxor": 8}
OP_NAMES: Dict[int, str] = {code: name for name, code in OP_CODES.items()}
_EXPECTED = "sum, mean (avg), min, max, prod (product), band, bor, bxor (any case) or a torch.distributed.ReduceOp"

_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_COMPLEX = (torch.complex64, torch.complex128)
#: integer dtypes the backends do not all carry, and the wider dtype they travel in (exact for every op)
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
_BITWISE = ("band", "bor", "bxor")


def parse_reduce_op(op: Any) -> str:
    """The canonical name of ``op`` (a string in any case, or a ``torch.distributed.ReduceOp``).
    Raises ValueError naming the accepted values."""
    if isinstance(op, str):
        name = _ALIASES.get(op.lower())
    else:
        raw = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
        name = _ALIASES.get(str(raw).lower())
    if name is None:
        raise ValueError(f"reduce_op={op!r} is not supported; expected {_EXPECTED}.")
    return name


def check_supported(op: str, supported: Any) -> None:
    """Raise ValueError when the strategy cannot run ``op`` (``mean`` runs as ``sum``)."""
    wire = "sum" if op == "mean" else op
    if wire not in supported:
        raise ValueError(f"reduce_op={op!r} is not supported by this strategy; it supports {sorted(supported)}.")


def wire_and_result(dtype: torch.dtype, op: str, python_number: bool = False) -> Tuple[torch.dtype, torch.dtype]:
    """``(wire dtype, result dtype)`` for a leaf of ``dtype`` under ``op``: integers are summed exactly in
    int64 for a mean and come back as float (float64 for Python numbers, the default dtype for tensors);
    bools are counted (int64) under sum, averaged under mean, and stay bool otherwise. Raises TypeError when
    ``op`` cannot apply to ``dtype``."""
    mean_float = torch.float64 if python_number else torch.get_default_dtype()
    if dtype == torch.bool:
        if op in ("sum", "mean"):
            return torch.int64, (torch.int64 if op == "sum" else mean_float)
        return torch.uint8, torch.bool
    if dtype in _INTS or dtype in _WIDER:
        wire = _WIDER.get(dtype, dtype)
        if op == "mean":
            return torch.int64, mean_float
        return wire, dtype
    if dtype in _FLOATS:
        if op in _BITWISE:
            raise TypeError(f"reduce_op={op!r} needs integer or bool leaves; got a {dtype} leaf.")
        return dtype, dtype
    if dtype in _COMPLEX:
        if op not in ("sum", "mean"):
            raise TypeError(f"reduce_op={op!r} is not defined for complex leaves ({dtype}); use sum or mean.")
        return dtype, dtype
    raise TypeError(f"{dtype} leaves cannot be reduced; convert them to a standard dtype (int64, float32, ...).")


def primitive_op(op: str) -> str:
    """The strategy primitive's op for ``op`` (a mean is a sum, divided afterwards)."""
    return "sum" if op == "mean" else op


def reduce_rows(rows: Tensor, op: str) -> Tensor:
    """Reduce ``rows`` ``(group_size, n)`` of one wire dtype over dim 0, exactly as the primitive would
    (mean: the sum; the division happens in ``finish``). The same rows give the same result on every rank."""
    dtype = rows.dtype
    if op in ("sum", "mean"):
        return rows.sum(0, dtype=dtype)
    if op == "min":
        return rows.amin(0)
    if op == "max":
        return rows.amax(0)
    if op == "prod":
        return rows.prod(0, dtype=dtype)
    return reduce_rows_bitwise(rows, op)


def finish(reduced: Tensor, op: str, result: torch.dtype, size: int, divided: bool = False) -> Tensor:
    """The reduced wire buffer as the caller sees it: a mean divided by ``size`` (unless the buffer was
    divided before the sum: ``divided``), cast to the ``result`` dtype. May reuse ``reduced``."""
    if op == "mean" and not divided:
        if reduced.dtype == result and (reduced.is_floating_point() or reduced.is_complex()):
            return reduced.div_(size)
        return torch.div(reduced, size).to(result)
    if reduced.dtype != result:
        return reduced.to(result)
    return reduced


def predivide(op: str, wire: torch.dtype, size: int) -> Optional[int]:
    """The divisor to apply while packing a mean, or None: only for floating wire dtypes and a power-of-two
    group size, where dividing first is exact (away from the ends of the float range: no overflow of the
    sum, no subnormals) and saves a pass over the buffer."""
    if op == "mean" and size & (size - 1) == 0 and (wire.is_floating_point or wire.is_complex):
        return size
    return None


#: the bitwise reductions; backends without them emulate them with an all-gather and ``reduce_rows_bitwise``
BITWISE_OPS: Dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


def reduce_rows_bitwise(rows: Tensor, op: str) -> Tensor:
    """``rows`` ``(group_size, ...)`` reduced over dim 0 by the bitwise ``op`` (band, bor or bxor)."""
    return functools.reduce(BITWISE_OPS[op], rows.unbind(0))


def check_native_reduce(backend: str, op: str, native: Collection[str], tensor: Tensor) -> None:
    """ValueError unless the ``backend`` runs ``op`` itself (one of ``native``; the bitwise ops are emulated
    before this check), and for a complex ``tensor`` under anything but sum."""
    if op not in native:
        raise ValueError(f"reduce op {op!r} is not supported by the {backend} strategy; expected one of "
                         f"{sorted([*native, *BITWISE_OPS])}.")
    if tensor.is_complex() and op != "sum":
        raise ValueError(f"reduce op {op!r} is not defined for complex tensors; only 'sum' is.")
