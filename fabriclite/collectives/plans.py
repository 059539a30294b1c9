"""Stage 2 of every collective: the plan, everything about one call that does not depend on the leaves'
values, made once per (structure, leaf metadata, call arguments, group) and cached on the structure's Spec.

A plan holds the layout (the buckets the leaves travel in: one typed flat buffer each, at a fixed place in a
byte row), the call every rank must agree on and its 32-bit tag, and what the later stages read per bucket, as
plain attributes (no method of a plan runs after this stage). Making a reduction's plan runs every check that
does not need the values: a bad ``reduce_op`` or ``dst``, an op a dtype does not take, a result
``inplace=True`` cannot hold. It raises before any communication; nothing is cached then.
"""
from __future__ import annotations

import hashlib
import operator
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from fabriclite.collectives import ops
from fabriclite.collectives.state import Context
from fabriclite.collectives.structure import NUMBER, OBJECT, TENSOR, Spec

ALIGN = 16  # the largest element size (complex128): every typed view of a byte row stays legal
_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_COMPLEX = (torch.complex64, torch.complex128)
#: integer dtypes the backends do not all carry, and the wider dtype they travel in (exact for every op)
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
#: wire dtypes and ops whose 0-d inline rows are reduced with numpy (the same IEEE / two's-complement
#: operations torch runs, without a tensor per step)
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64}
_NUMPY_OPS: Dict[str, Any] = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum,
                              "prod": np.multiply}
_HINTS = {"cat": " (with cat=True, dim 0 may differ)",
          "stack": " (pass cat=True to concatenate tensors whose dim 0 differs)"}


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ---------------------------------------------------------------------------------------------- calls
BARRIER, BROADCAST, ALL_REDUCE, ALL_GATHER, GATHER, REDUCE = range(1, 7)
KIND_NAMES = {BARRIER: "barrier", BROADCAST: "broadcast", ALL_REDUCE: "all_reduce", ALL_GATHER: "all_gather",
              GATHER: "gather", REDUCE: "reduce"}
FLAG_CAT = 1
MAGIC = 0x464C4332  # "FLC2": fabriclite collectives, protocol 2
#: a header word's halves are 32 bits: the largest tag and the largest size (in header.UNIT units)
MAX_SIZE = (1 << 32) - 1
_PACK_CALL = struct.Struct("<8q")


class Call(NamedTuple):
    """What every rank of one collective call must agree on (the header carries its tag)."""

    kind: int
    op: int = 0
    root: int = -1
    flags: int = 0
    digest: Tuple[int, int] = (0, 0)
    fixed: int = 0


def call_tag(call: Call) -> int:
    """The 32-bit tag of ``call``: never 0 or 1 (header.TAG_NONE, TAG_ERROR), the same in every process."""
    raw = hashlib.blake2b(_PACK_CALL.pack(MAGIC, call.kind, call.op, call.root, call.flags, call.digest[0],
                                          call.digest[1], call.fixed), digest_size=8).digest()
    return int.from_bytes(raw, "little") % (MAX_SIZE - 1) + 2


def tag(ctx: Context, call: Call) -> int:
    """``call_tag(call)``, remembered per strategy."""
    tags = ctx.state.tags
    value = tags.get(call)
    if value is None:
        value = tags[call] = call_tag(call)
    return value


# ---------------------------------------------------------------------------------------------- layouts
@dataclass
class Bucket:
    """Leaves that travel together as one typed flat buffer: ``ids`` (user-order leaf indices, canonical
    order), their numels and shapes, the ``wire`` dtype and the ``result`` dtype they come back in, and
    their byte ``offset`` in a row. ``mode``: "scalars" (0-d CPU tensors, read with item()), "numbers"
    (Python numbers), "single" (one tensor) or "general"; ``scalar``: every leaf is 0-d. ``whole``: the bucket
    holds every leaf, and (0-d modes) is packed in the caller's order and permuted to the canonical one on the
    wire by ``perm``, back by ``inverse_np`` (``index[device]``: both as index tensors). ``take``: an
    itemgetter of the bucket's leaves from all leaves, or None when they are all leaves in order.
    ``elsewhere[device]``: a tensor leaf lives on another device. ``cache``: pools and views of reused buffers."""

    wire: torch.dtype
    result: torch.dtype
    ids: List[int]
    numels: List[int]
    shapes: List[Tuple[int, ...]]
    mode: str
    devices: List[Optional[torch.device]]
    whole: bool
    take: Optional[Callable[[Sequence[Any]], Sequence[Any]]]
    numel: int = 0
    nbytes: int = 0
    scalar: bool = False
    offset: int = 0
    perm: Optional[List[int]] = None
    inverse_np: Any = None
    index: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)
    elsewhere: Dict[torch.device, bool] = field(default_factory=dict, repr=False)
    cache: Dict[Any, Any] = field(default_factory=dict, repr=False)


@dataclass
class Layout:
    """How one rank's leaves sit in a byte row: ``nvar`` int64 words of varying dims first, then the fixed
    ``buckets`` (same place on every rank) up to ``fixed_end``, then the ``var_ids`` tensors, then the
    pickled ``object_ids`` leaves. ``var_dims``: per var tensor, "first" (only dim 0 varies) or "all".
    ``used``: bytes up to the end of the last bucket; ``fixed_only``: no var tensors, no objects."""

    buckets: List[Bucket]
    fixed_end: int
    nvar: int = 0
    var_ids: List[int] = field(default_factory=list)
    var_dims: str = "first"
    object_ids: List[int] = field(default_factory=list)
    passthrough_ids: List[int] = field(default_factory=list)
    used: int = field(init=False)
    fixed_only: bool = field(init=False)

    def __post_init__(self) -> None:
        self.used = max((b.offset + b.nbytes for b in self.buckets), default=self.nvar * 8)
        self.fixed_only = not self.var_ids and not self.object_ids


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
        if op in ops.BITWISE_OPS:
            raise TypeError(f"reduce_op={op!r} needs integer or bool leaves; got a {dtype} leaf.")
        return dtype, dtype
    if dtype in _COMPLEX:
        if op not in ("sum", "mean"):
            raise TypeError(f"reduce_op={op!r} is not defined for complex leaves ({dtype}); use sum or mean.")
        return dtype, dtype
    raise TypeError(f"{dtype} leaves cannot be reduced; convert them to a standard dtype (int64, float32, ...).")


def reduce_layout(spec: Spec, op: str) -> Layout:
    """Buckets for a reduction with ``op`` (cached on ``spec``): tensors and numbers grouped by (wire,
    result) dtype; other leaves pass through. Raises TypeError when ``op`` does not apply to a leaf's dtype."""
    key = ("reduce", op)
    layout = spec.plans.get(key)
    if layout is None:
        groups: Dict[Tuple[torch.dtype, torch.dtype], List[int]] = OrderedDict()
        passthrough = []
        for i in spec.order:
            leaf = spec.leaves[i]
            if leaf.kind == OBJECT:
                passthrough.append(i)
                continue
            assert leaf.dtype is not None
            try:
                pair = wire_and_result(leaf.dtype, op, python_number=leaf.kind == NUMBER)
            except TypeError as err:
                raise TypeError(f"{spec.paths[i]}: {err}") from None
            groups.setdefault(pair, []).append(i)
        buckets = [_bucket(spec, wire, result, ids) for (wire, result), ids in groups.items()]
        layout = spec.plans[key] = Layout(buckets, _place(buckets, 0), passthrough_ids=passthrough)
    return layout


def gather_layout(spec: Spec, mode: str) -> Layout:
    """Row layout for ``mode`` (cached on ``spec``): "stack" (every tensor and number stacked; objects
    pickled), "cat" (tensors with dims concatenated along dim 0, which may differ) or "gather" (every tensor
    may differ in every dim; numbers and objects pickled)."""
    layout = spec.plans.get(mode)
    if layout is None:
        groups: Dict[torch.dtype, List[int]] = OrderedDict()
        var_ids, object_ids = [], []
        for i in spec.order:
            leaf = spec.leaves[i]
            if leaf.kind == OBJECT or (leaf.kind == NUMBER and mode == "gather"):
                object_ids.append(i)
            elif leaf.kind == TENSOR and (mode == "gather" or (mode == "cat" and leaf.shape)):
                var_ids.append(i)
            else:
                assert leaf.dtype is not None
                groups.setdefault(leaf.dtype, []).append(i)
        nvar = len(var_ids) if mode == "cat" else sum(len(spec.leaves[i].shape) for i in var_ids)
        buckets = [_bucket(spec, dtype, dtype, ids) for dtype, ids in groups.items()]
        end = _place(buckets, nvar * 8)
        layout = spec.plans[mode] = Layout(buckets, end, nvar, var_ids, "first" if mode == "cat" else "all",
                                           object_ids)
    return layout


def _bucket(spec: Spec, wire: torch.dtype, result: torch.dtype, ids: List[int]) -> Bucket:
    leaves = [spec.leaves[i] for i in ids]
    if all(leaf.kind == NUMBER for leaf in leaves):
        mode = "numbers"
    elif all(leaf.kind == TENSOR and not leaf.shape and leaf.device is not None and leaf.device.type == "cpu"
             for leaf in leaves):
        mode = "scalars"
    elif len(ids) == 1:
        mode = "single"
    else:
        mode = "general"
    total = len(spec.leaves)
    whole = sorted(ids) == list(range(total))
    bucket = Bucket(wire, result, ids, [leaf.numel for leaf in leaves], [leaf.shape for leaf in leaves], mode,
                    [leaf.device for leaf in leaves], whole, _taker(ids, total), scalar=mode in ("scalars", "numbers"))
    if whole and bucket.scalar:  # packed in the caller's order, permuted to the canonical one on the wire
        bucket.take = None
        if ids != list(range(total)):
            bucket.perm = list(ids)
            bucket.inverse_np = np.argsort(np.asarray(ids, dtype=np.int64))
    bucket.numel = sum(bucket.numels)
    bucket.nbytes = bucket.numel * wire.itemsize
    return bucket


def _place(buckets: List[Bucket], start: int) -> int:
    offset = align(start)
    for bucket in buckets:
        bucket.offset = offset
        offset = align(offset + bucket.nbytes)
    return offset


def _taker(ids: List[int], total: int) -> Optional[Callable[[Sequence[Any]], Sequence[Any]]]:
    if ids == list(range(total)):
        return None
    if len(ids) == 1:
        return operator.itemgetter(slice(ids[0], ids[0] + 1))
    return operator.itemgetter(*ids)


def _on_device(buckets: List[Bucket], device: torch.device) -> None:
    """Each bucket's per-device facts for ``device`` (index tensors, whether a leaf lives elsewhere)."""
    for b in buckets:
        if device not in b.elsewhere:
            b.elsewhere[device] = any(d is not None and d != device for d in set(b.devices))
        if b.perm is not None and device not in b.index:
            perm = torch.tensor(b.perm, dtype=torch.int64, device=device)
            b.index[device] = (perm, torch.from_numpy(b.inverse_np).to(device))


# ---------------------------------------------------------------------------------------------- plans
class Plan:
    """One reduction call's plan (see the module docstring); per bucket, in ``buckets`` order: ``divisors``
    (a mean over a power-of-two group divided while packing, or None), ``tensors`` (the bucket holds a tensor
    leaf), ``direct`` (``inplace``: the caller's tensor can be its own wire buffer if contiguous), ``np_dtypes``
    (the numpy dtype its inline rows are reduced in, or None)."""

    def __init__(self, ctx: Context, spec: Spec, op: str, kind: int, root: int, inplace: bool) -> None:
        self.op = op
        self.primitive = ops.primitive_op(op)
        self.inplace = inplace
        self.layout = layout = reduce_layout(spec, op)
        self.buckets = buckets = layout.buckets
        self.leaf_kinds = [leaf.kind for leaf in spec.leaves]
        if inplace:
            _check_inplace(spec, layout, op)
        self.call = Call(kind, ops.OP_CODES[op], root, 0, spec.digests["reduce"], layout.fixed_end)
        self.tag = tag(ctx, self.call)
        self.lines = spec.lines["reduce"]
        _on_device(buckets, ctx.device)
        self.tensors = [any(self.leaf_kinds[i] == TENSOR for i in b.ids) for b in buckets]
        self.direct = [b.mode == "single" and _is_wire(spec, b, ctx.device) for b in buckets]
        self.reduce_np = _NUMPY_OPS.get(op)
        self.np_dtypes = [_NUMPY_DTYPES.get(b.wire) if b.scalar and b.wire == b.result and self.reduce_np else None
                          for b in buckets]
        #: a mean over a power-of-two group divides while packing (exact away from the ends of the float
        #: range: no overflow of the sum, no subnormals) and saves a pass over the buffer
        self.divisors = [ctx.size if op == "mean" and ctx.size & (ctx.size - 1) == 0
                         and (b.wire.is_floating_point or b.wire.is_complex) else None for b in buckets]


def _is_wire(spec: Spec, bucket: Bucket, device: torch.device) -> bool:
    leaf = spec.leaves[bucket.ids[0]]
    return leaf.kind == TENSOR and leaf.dtype == bucket.wire == bucket.result and leaf.device == device


def _check_inplace(spec: Spec, layout: Layout, op: str) -> None:
    """ValueError naming the first tensor leaf whose result dtype differs from its own (an integer or bool
    mean, a bool sum): such a result cannot be written into the caller's tensor without changing it."""
    for bucket in layout.buckets:
        for i in bucket.ids:
            leaf = spec.leaves[i]
            if leaf.kind == TENSOR and leaf.dtype != bucket.result:
                raise ValueError(
                    f"inplace=True: the {op} of {spec.paths[i]} ({str(leaf.dtype).replace('torch.', '')} tensor) "
                    f"is {str(bucket.result).replace('torch.', '')}, which the tensor cannot hold without "
                    f"truncating. Pass inplace=False (the result comes back as a new tensor), a floating-point "
                    f"tensor, or another reduce_op.")


def plan_reduce(ctx: Context, spec: Spec, reduce_op: Any, kind: int, dst: Optional[int], inplace: bool) -> Plan:
    """The cached plan for reducing leaves of ``spec`` with ``reduce_op`` over ``ctx``'s group; made (and
    checked) on first use. Raises ValueError / TypeError for a bad call (see the module docstring)."""
    key = ("call", kind, reduce_op, dst, inplace, ctx.group, ctx.size, ctx.device)
    try:
        plan = spec.plans.get(key)
    except TypeError:  # an unhashable reduce_op: not cached
        key, plan = None, None
    if plan is None:
        op = ops.parse_reduce_op(reduce_op)
        ops.check_supported(op, ctx.strategy.supported_reduce_ops)
        if dst is not None:
            ctx.member_index(dst, f"dst={dst}")
        plan = Plan(ctx, spec, op, kind, -1 if dst is None else dst, inplace)
        if key is not None:
            spec.plans[key] = plan
    return plan


class GatherPlan:
    """One all_gather / gather call's plan: the ``mode`` ("stack", "cat" or "gather"), its ``layout``, the
    ``call`` every rank agrees on and its ``tag``, this rank's ``lines`` and the ``hint`` a mismatch ends with."""

    def __init__(self, ctx: Context, spec: Spec, mode: str, call: Call) -> None:
        self.mode = mode
        self.layout = gather_layout(spec, mode)
        self.call = call._replace(digest=spec.digests[mode], fixed=self.layout.fixed_end)
        self.tag = tag(ctx, self.call)
        self.lines = spec.lines[mode]
        self.hint = _HINTS.get(mode, "")
        _on_device(self.layout.buckets, ctx.device)


def plan_gather(ctx: Context, spec: Spec, mode: str, call: Call) -> GatherPlan:
    """The cached plan for gathering leaves of ``spec`` in ``mode`` with ``call`` (kind, flags, root)."""
    key = ("gather call", mode, call)
    plan = spec.plans.get(key)
    if plan is None:
        plan = spec.plans[key] = GatherPlan(ctx, spec, mode, call)
    return plan
