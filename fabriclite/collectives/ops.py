"""Reduce operations: the names accepted for ``reduce_op`` and the header code of each, the strategy primitive
an op runs as, and the bitwise emulation and op checks the strategies share. (The dtype each leaf travels and
comes back in is the plan's: plans.wire_and_result; the reduction of inline rows on this rank is unpacking's.)"""
from __future__ import annotations

import functools
from typing import Any, Callable, Collection, Dict

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


def primitive_op(op: str) -> str:
    """The strategy primitive's op for ``op`` (a mean is a sum, divided afterwards)."""
    return "sum" if op == "mean" else op


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
