"""all_gather(sync_grads=True): gradients flow back to every rank's inputs.

The gathered outputs are computed once (without autograd); one autograd Function ties the inputs that
require grad to them. Its backward sums every rank's output gradients with one primitive all_reduce per
dtype and hands each rank the slice that belongs to its own input (as Lightning's ``_AllGather``, for a
whole collection at once). Every rank must run the backward (it is a collective).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fabriclite.collectives.plans import Layout
from fabriclite.collectives.state import Context
from fabriclite.collectives.structure import Spec


class _Plan:
    """What the backward needs: per input, "stack" or "cat", its shape, and (cat) every rank's dim 0."""

    def __init__(self, ctx: Context, entries: List[Tuple[str, Tuple[int, ...], List[int]]],
                 outputs: List[Tensor]) -> None:
        self.ctx = ctx
        self.entries = entries
        self.outputs = outputs

    def rank_rows(self, grad: Optional[Tensor], k: int) -> Tensor:
        """Output gradient ``k`` as ``(size, m)``: row r is what rank r's input ``k`` received."""
        mode, shape, sizes = self.entries[k]
        out = self.outputs[k]
        size = self.ctx.size
        if grad is None:
            grad = torch.zeros_like(out)
        if mode == "stack":
            return grad.reshape(size, -1)
        rest = out[0].numel() if out.shape[0] else 0
        width = max(sizes) * rest
        rows = grad.new_zeros((size, width))
        start = 0
        for r, n in enumerate(sizes):
            rows[r, : n * rest] = grad[start:start + n].reshape(-1)
            start += n
        return rows

    def backward(self, grads: Sequence[Optional[Tensor]]) -> List[Tensor]:
        rows = [self.rank_rows(g, k) for k, g in enumerate(grads)]
        by_dtype: dict = {}
        for k, r in enumerate(rows):
            by_dtype.setdefault(r.dtype, []).append(k)
        result: List[Optional[Tensor]] = [None] * len(rows)
        for ks in by_dtype.values():
            flat = torch.cat([rows[k] for k in ks], dim=1).contiguous()
            if self.ctx.size > 1:
                flat = self.ctx.strategy.flat_all_reduce(flat, "sum", self.ctx.group)
            mine = flat[self.ctx.index]
            start = 0
            for k in ks:
                width = rows[k].shape[1]
                _, shape, _ = self.entries[k]
                numel = 1
                for s in shape:
                    numel *= s
                result[k] = mine[start:start + numel].reshape(shape).clone()
                start += width
        return [r for r in result if r is not None]


class _GatherGrads(torch.autograd.Function):
    @staticmethod
    def forward(fctx: Any, plan: _Plan, *inputs: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
        fctx.plan = plan
        return tuple(o.clone() if o._base is not None else o for o in plan.outputs)

    @staticmethod
    def backward(fctx: Any, *grads: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:  # type: ignore[override]
        return (None, *fctx.plan.backward(grads))


def attach_gather_grads(ctx: Context, spec: Spec, layout: Layout, leaves: Sequence[Any], outs: List[Any],
                        var_shapes: List[List[Tuple[int, ...]]]) -> List[Any]:
    """``outs`` with the outputs of inputs that require grad replaced by differentiable ones."""
    var_pos = {i: k for k, i in enumerate(layout.var_ids)}
    ids, entries, outputs = [], [], []
    for i, x in enumerate(leaves):
        if not (isinstance(x, Tensor) and x.requires_grad) or not isinstance(outs[i], Tensor):
            continue
        if i in var_pos:
            entries.append(("cat", tuple(x.shape), [s[0] for s in var_shapes[var_pos[i]]]))
        else:
            entries.append(("stack", tuple(x.shape), []))
        ids.append(i)
        outputs.append(outs[i])
    if not ids:
        return outs
    plan = _Plan(ctx, entries, outputs)
    results = _GatherGrads.apply(plan, *[leaves[i] for i in ids])
    outs = list(outs)
    for i, out in zip(ids, results):
        outs[i] = out
    return outs
