"""The plan stage of a reduction: everything about one call that does not depend on the leaves' values,
made once per (structure, leaf metadata, call arguments, group) and cached on the structure's Spec.

A plan holds the parsed op, the buckets, the call description and tag every rank compares, and what each
bucket needs per call (whether the caller's tensor can be reduced where it is, which leaves are tensors,
the numpy view of the header rows a 0-d bucket is reduced from). Making it runs every check that does not
need the values: a bad ``reduce_op`` or ``dst``, an op a dtype does not take, a result ``inplace=True``
cannot hold. It raises before any communication; nothing is cached then.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from fabriclite.collectives import header, ops
from fabriclite.collectives.spec import TENSOR, Bucket, Layout, Spec
from fabriclite.collectives.state import Context
from fabriclite.collectives.tree import Tree

#: wire dtypes and ops whose 0-d inline rows are reduced with numpy (the same IEEE / two's-complement
#: operations torch runs, without a tensor per step)
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64}
_NUMPY_OPS: Dict[str, Any] = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum,
                              "prod": np.multiply}


class Plan:
    """One reduction call's plan (see the module docstring)."""

    def __init__(self, ctx: Context, spec: Spec, op: str, kind: int, root: int, inplace: bool) -> None:
        self.op = op
        self.primitive = ops.primitive_op(op)
        self.inplace = inplace
        self.layout: Layout = spec.reduce_layout(op)
        self.leaf_kinds = [leaf.kind for leaf in spec.leaves]
        if inplace:
            _check_inplace(spec, self.layout, op)
        self.call = header.Call(kind, ops.OP_CODES[op], root, 0, spec.digest("reduce"), self.layout.fixed_end)
        self.tag = header.tag(ctx, self.call)
        self.describe = lambda: spec.describe("reduce")
        self._tensors = {id(b): any(self.leaf_kinds[i] == TENSOR for i in b.ids) for b in self.layout.buckets}
        self._direct = {id(b): _may_be_direct(spec, b, ctx.device) for b in self.layout.buckets}
        self._reduce_np = _NUMPY_OPS.get(op)
        #: per bucket: the divisor a mean is divided by while packing (a power-of-two group), or None
        self.divisors = [ops.predivide(op, b.wire, ctx.size) for b in self.layout.buckets]

    def tensor_ids(self, bucket: Bucket) -> bool:
        """Whether the bucket holds a tensor leaf."""
        return self._tensors[id(bucket)]

    def direct_tensor(self, bucket: Bucket, leaves: Sequence[Any], device: torch.device) -> Optional[Tensor]:
        """``inplace``: the caller's tensor when the bucket is that one tensor and it can be reduced where it
        is (contiguous, on ``device``, its dtype the wire and the result dtype); else None."""
        if not self._direct[id(bucket)]:
            return None
        tensor = leaves[bucket.ids[0]]
        return tensor if tensor.is_contiguous() else None

    def inline_numpy(self, bucket: Bucket, words: header.Words) -> Optional[Any]:
        """The ``(size, numel)`` numpy view of the bucket in every rank's inline row, when this bucket is
        reduced with numpy (0-d leaves, a CPU header, a plain wire dtype that is also the result's); None
        otherwise."""
        if words.result is not words.gathered:  # the strategy returned another buffer: no numpy view of it
            return None
        key = ("inline numpy", id(words))
        cached = bucket.cache.get(key)
        if cached is None or cached[0] is not words:
            np_dtype = _NUMPY_DTYPES.get(bucket.wire)
            view = None
            if (words.numpy is not None and bucket.scalar and np_dtype is not None and bucket.wire == bucket.result
                    and self._reduce_np is not None):
                raw = words.numpy.view(np.uint8)[:, :words.capacity]
                view = raw[:, bucket.offset:bucket.offset + bucket.nbytes].view(np_dtype)
            cached = bucket.cache[key] = (words, view)
        return cached[1]

    def reduce_numpy(self, values: Any) -> Any:
        """``values`` ``(size, numel)`` reduced over the ranks: a new array (the mean not yet divided)."""
        ufunc = self._reduce_np
        assert ufunc is not None
        if len(values) == 2:  # one binary op costs less than a reduction
            return ufunc(values[0], values[1])
        return ufunc.reduce(values, axis=0, dtype=values.dtype)  # numpy sums int32 as int64 otherwise


def _may_be_direct(spec: Spec, bucket: Bucket, device: torch.device) -> bool:
    if bucket.mode != "single":
        return False
    leaf = spec.leaves[bucket.ids[0]]
    return (leaf.kind == TENSOR and leaf.dtype == bucket.wire == bucket.result and leaf.device == device)


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


def plan_reduce(ctx: Context, tree: Tree, leaves: Sequence[Any], reduce_op: Any, kind: int, dst: Optional[int],
                inplace: bool) -> Plan:
    """The cached plan for reducing ``leaves`` (structure ``tree``) with ``reduce_op`` over ``ctx``'s group;
    made (and checked) on first use. Raises ValueError / TypeError for a bad call (see the module docstring)."""
    spec = ctx.state.specs.get(tree, leaves)
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


__all__: List[str] = ["Plan", "plan_reduce"]
