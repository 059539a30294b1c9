"""Collection-aware collectives, written once on top of a strategy's primitives.

Every function takes the strategy first and works on a tensor, a Python number or object, or a nested
collection of them (dict / OrderedDict / defaultdict / any Mapping, list, tuple, namedtuple, dataclass).
``Fabric.all_reduce`` & co. forward here.

- One collective per call for small data, one per (dtype) bucket after one small header for large data;
  never one per leaf, never a barrier before a reduce.
- Agreement first: every rank sends a fixed-size header (the collective, its op and root, a digest of the
  collection's structure, byte counts, a local-error flag). A mismatch (different keys, shapes, dtypes,
  collectives, ops, ``src``) or a local error on one rank (a bad ``reduce_op``, an unpicklable leaf) raises
  ``CollectiveMismatchError`` (a ValueError) with the same message on every rank, before any data moves;
  the group stays usable. ``check=False`` skips the header where a call can do without it (a hot loop whose
  structure you trust): mismatches are then undefined, as with torch.distributed.
- Dict keys meet by key: two ranks with the same keys in a different insertion order agree; each rank gets
  back its own container types and key order.
- Inputs are never modified, unless ``inplace=True`` (all_reduce, reduce) asks for tensor leaves to be
  reduced in the caller's tensors.
- Errors after data has started moving (a collective timeout, a lost peer) are fatal for the process group:
  the strategy raises them and every later collective fails; end and restart the job.

Each call is one pipeline, written out in its function below: every stage lives in one module, which the call
enters once, and the data passes through each stage once:

    1 flatten, its spec (structure.py, cached) -> 2 plan (plans.py, cached) -> 3 pack (packing.py)
    -> 4 agree, 5 wire (header.py) -> 6 unpack, 7 rebuild (unpacking.py)

Every object another rank sent is loaded by the restricted unpickler of ``object_pickle`` (``add_safe_globals``
allows more); ``object_wire`` holds the object collectives the strategies build on that unpickler.

Agree is the header exchange, the first collective of every call, which carries small data itself; wire moves
what did not fit, in one more collective. barrier and rank_zero_first are in sync.py.

May import: ``distributed`` only (never a strategy: ``state.Strategy`` is a Protocol naming the
primitives used).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from fabriclite.collectives import sync
from fabriclite.collectives.buffers import POOL_MIN_LEAVES, stacked_slot
from fabriclite.collectives.header import CollectiveMismatchError, agree, fail, wire_message, wire_reduce, wire_rows
from fabriclite.collectives.packing import begin, pack_message, pack_reduce, pack_row
from fabriclite.collectives.plans import (ALL_GATHER, ALL_REDUCE, BROADCAST, FLAG_CAT, GATHER, REDUCE, Call,
                                          GatherPlan, plan_gather, plan_reduce, tag)
from fabriclite.collectives.state import Context, Strategy, context
from fabriclite.collectives.structure import flatten
from fabriclite.collectives.sync import RankZeroFailed
from fabriclite.collectives.unpacking import gathered, gathered_per_rank, rebuild, reduced, unpickled

__all__ = ["CollectiveMismatchError", "RankZeroFailed", "all_gather", "all_reduce", "barrier", "broadcast",
           "gather", "rank_zero_first", "reduce"]


def barrier(strategy: Strategy, name: Optional[str] = None, group: Any = None, check: bool = True) -> None:
    """Return once every rank of ``group`` (default: all) has called barrier. ``name`` is informational.
    Raises CollectiveMismatchError on every rank when another rank called a different collective here."""
    sync.barrier(context(strategy, group), name, check)


def broadcast(strategy: Strategy, obj: Any, src: int = 0, group: Any = None, check: bool = True) -> Any:
    """``obj`` of global rank ``src`` on every rank of ``group``.

    Any picklable object or nested collection; tensors travel as tensors (not pickled) and arrive as plain
    tensors on each receiver's device (``fabric.device``); ``src`` gets its own ``obj`` back (the same
    object). What the other ranks pass is ignored. ``src`` out of range is a ValueError (on every rank),
    ranks passing different ``src`` a CollectiveMismatchError.
    """
    ctx = context(strategy, group)
    if ctx.size == 1:
        ctx.member_index(src, f"src={src}")
        return obj
    call = Call(BROADCAST, root=src)
    with torch.no_grad():
        try:
            src_index = ctx.member_index(src, f"src={src}")
            msg = pack_message(ctx, obj, ctx.index == src_index, check)  # 3 pack
        except Exception as err:  # on one rank only, maybe: every rank must hear of it
            if not check:
                raise
            fail(ctx, begin(ctx), call, err)
        lows = None if msg.words is None else agree(ctx, msg.words, tag(ctx, call), msg.low, call)  # 4 agree
        got = wire_message(ctx, msg, src, src_index, lows)  # 5 wire
        return obj if got is None else unpickled(*got)  # 6 unpack


def all_gather(strategy: Strategy, data: Any, group: Any = None, sync_grads: bool = False, cat: bool = False,
               check: bool = True) -> Any:
    """Every rank's ``data``, leaf by leaf, in group-rank order.

    - A tensor leaf comes back stacked ``(group_size, *shape)``; with ``cat=True`` concatenated along dim 0
      (``(sum of every rank's dim 0, *shape[1:])``), and then dim 0 may differ between ranks (0-d leaves
      are stacked). Without ``cat``, different shapes raise CollectiveMismatchError on every rank, listing
      each rank's shape.
    - A Python number becomes an exact tensor (bool, int64, float64, complex128) stacked like a tensor.
    - Any other leaf (a string, an object) comes back as a list of every rank's value.
    - One process without process groups (SingleDeviceStrategy), as in Lightning: tensors and numbers come
      back without the stacking dim (a copy; numbers as 0-d tensors), other leaves as a one-item list.
    - ``sync_grads=True``: differentiable; the backward sums every rank's output gradients into each
      rank's inputs (every rank must run the backward).
    """
    ctx = context(strategy, group)
    mode = "cat" if cat else "stack"
    call = Call(ALL_GATHER, flags=FLAG_CAT if cat else 0)
    with torch.no_grad():
        try:
            tree, leaves, spec, stacked = ctx.state.specs.take_apart(data, mode)  # 1 flatten, its spec
            plan = plan_gather(ctx, spec, mode, call)  # 2 plan (cached)
            row = pack_row(ctx, plan, leaves, ctx.size > 1 and (check or not plan.layout.fixed_only),
                           stacked)  # 3 pack
        except Exception as err:  # on one rank only, maybe: every rank must hear of it
            if ctx.size == 1 or not check:
                raise
            fail(ctx, begin(ctx), call, err)
        words = row.words
        slots: Dict[Any, Any] = {}
        lows = None if words is None else agree(ctx, words, plan.tag, row.low, plan.call, plan.lines, plan.hint,
                                                _finding(slots, plan, ctx, tree, data, sync_grads))  # 4 agree
        got = wire_rows(ctx, plan, row, lows)  # 5 wire
    return gathered(ctx, spec, plan, leaves, got, tree, data, sync_grads, slots)  # 6 unpack, 7 rebuild


def _finding(slots: Dict[Any, Any], plan: GatherPlan, ctx: Context, tree: Any, data: Any,
             sync_grads: bool) -> Optional[Callable[[], None]]:
    """What an all_gather can do while its header is exchanged: find the result buffers of its pooled 0-d buckets
    (checking a reused buffer's views touches each of them: about as long as the exchange itself for 1,000
    leaves on a loaded machine), into ``slots`` by bucket index, and, when those views are the whole result
    (one such bucket holding every leaf, on this device, without ``sync_grads``), the result itself, rebuilt
    around them (``slots["result"]``; the values are written into them once they arrive). None when it has
    no such bucket."""
    layout = plan.layout
    pooled = [(k, b) for k, b in enumerate(layout.buckets) if b.scalar and len(b.ids) >= POOL_MIN_LEAVES]
    if not pooled or ctx.size == 1:
        return None
    whole = (len(layout.buckets) == 1 and layout.fixed_only and layout.buckets[0].whole and not sync_grads
             and not ctx.single_device and not layout.buckets[0].elsewhere[ctx.device])

    def find() -> None:
        for k, bucket in pooled:
            slots[k] = stacked_slot(bucket, ctx.size, ctx.device)
        if whole:
            slots["result"] = rebuild(tree, slots[0].views, data)
    return find


def all_reduce(strategy: Strategy, data: Any, group: Any = None, reduce_op: Any = "mean",
               check: bool = True, inplace: bool = False) -> Any:
    """``data`` reduced leaf by leaf over the ranks of ``group``; the same result on every rank.

    ``reduce_op``: sum, mean (avg), min, max, prod (product), band, bor, bxor in any case, or a
    ``torch.distributed.ReduceOp``. Tensor and Python-number leaves are reduced: numbers come back as 0-d
    tensors on ``fabric.device``, exact (int64 / float64 / bool / complex128); integer tensors and ints
    under mean come back as float (the default dtype for tensors, float64 for ints); bools count under
    sum (int64) and are all / any under min, prod, band / max, bor. Other leaves are returned unchanged.
    By default the input is never modified; results are not differentiable. Every rank must pass the same
    keys, dtypes and shapes (CollectiveMismatchError otherwise, on every rank); a bad ``reduce_op`` or a
    dtype the op does not apply to (band on floats) raises CollectiveMismatchError on every rank
    (ValueError / TypeError when one process runs alone).

    ``inplace=True``: tensor leaves are reduced in the caller's tensors, as torch.distributed and Lightning
    do, and the result holds those same tensor objects (no copy of a large tensor). Number and object leaves
    behave as by default. A tensor whose result dtype differs from its own (the mean of an integer or bool
    tensor, the sum of a bool tensor) cannot be reduced in place: ValueError (CollectiveMismatchError on
    every rank), raised before any data moves, and no tensor is changed then.
    """
    return _reduce(context(strategy, group), data, reduce_op, check, ALL_REDUCE, None, inplace)


def gather(strategy: Strategy, data: Any, dst: int = 0, group: Any = None) -> Optional[List[Any]]:
    """On global rank ``dst``: a list of every rank's ``data`` in group-rank order (tensors on
    ``fabric.device``, numbers and objects as they were); None on the other ranks.

    Every rank must pass the same structure (keys, dtypes, number of dims); tensor sizes may differ.
    Built on all_gather (no gather primitive is assumed), so every rank moves every rank's data.
    """
    ctx = context(strategy, group)
    call = Call(GATHER, root=dst)
    with torch.no_grad():
        try:
            ctx.member_index(dst, f"dst={dst}")
            tree, leaves = flatten(data)  # 1 flatten
            spec = ctx.state.specs.get(tree, leaves, "gather")
            plan = plan_gather(ctx, spec, "gather", call)  # 2 plan (cached)
            row = pack_row(ctx, plan, leaves, ctx.size > 1)  # 3 pack
        except Exception as err:  # on one rank only, maybe: every rank must hear of it
            if ctx.size == 1:
                raise
            fail(ctx, begin(ctx), call, err)
        words = row.words
        lows = None if words is None else agree(ctx, words, plan.tag, row.low, plan.call, plan.lines)  # 4 agree
        got = wire_rows(ctx, plan, row, lows)  # 5 wire
        if ctx.strategy.global_rank != dst:
            return None
    assert got.rows is not None
    return gathered_per_rank(spec, plan.layout, leaves, got.rows, tree, data)  # 6 unpack, 7 rebuild


def reduce(strategy: Strategy, data: Any, dst: int = 0, reduce_op: Any = "mean", group: Any = None,
           check: bool = True, inplace: bool = False) -> Any:
    """``all_reduce``'s result on global rank ``dst``; None on the other ranks (the reduction itself is
    an all_reduce: every rank computes it). ``inplace=True`` as for ``all_reduce``; every rank's tensors
    then hold the result."""
    return _reduce(context(strategy, group), data, reduce_op, check, REDUCE, dst, inplace)


@contextmanager
def rank_zero_first(strategy: Strategy, local: bool = False) -> Iterator[None]:
    """Rank 0 (with ``local=True``: each node's local rank 0) runs the block first; the others wait for it
    without a deadline (waiting for a download is not a fault), then run the block. If rank 0's block
    raises, the waiting ranks raise RankZeroFailed naming rank 0's error instead of running the block
    or hanging. Uses the job's store (no process group is created per call); without a store, rank 0
    broadcasts its outcome (then the collective timeout bounds the wait, and ``local`` acts as global)."""
    with sync.rank_zero_first(strategy, local, broadcast):
        yield


#: autograd off and on again without a context manager object per call
_set_grad = getattr(torch._C, "_set_grad_enabled", torch.set_grad_enabled)


def _reduce(ctx: Context, data: Any, reduce_op: Any, check: bool, kind: int, dst: Optional[int],
            inplace: bool) -> Any:
    """all_reduce (``kind`` ALL_REDUCE) or reduce (REDUCE: the result on global rank ``dst`` only, None
    elsewhere), without autograd: results are not differentiable; in-place writes into tensors that require
    grad are allowed."""
    grad = torch.is_grad_enabled()
    if grad:
        _set_grad(False)
    try:
        checked = check and ctx.size > 1
        try:
            tree, leaves, spec, stacked = ctx.state.specs.take_apart(data, "reduce")  # 1 flatten, its spec
            plan = plan_reduce(ctx, spec, reduce_op, kind, dst, inplace)  # 2 plan (cached)
            packed = pack_reduce(ctx, plan, leaves, checked, stacked)  # 3 pack
        except Exception as err:  # on one rank only, maybe: every rank must hear of it
            if not checked:
                raise
            fail(ctx, begin(ctx), Call(kind, root=-1 if dst is None else dst), err)
        if packed.words is not None:
            agree(ctx, packed.words, plan.tag, packed.low, plan.call, plan.lines)  # 4 agree
        keep = dst is None or ctx.ranks[ctx.index] == dst
        wired = wire_reduce(ctx, plan, packed, finish=keep or inplace)  # 5 wire
        if not keep and not inplace:
            return None
        return reduced(ctx, plan, leaves, wired, tree, data, keep)  # 6 unpack, 7 rebuild
    finally:
        if grad:
            _set_grad(True)
