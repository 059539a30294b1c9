"""Stages 4 and 5 of every collective: agree (the header exchange, the first and for small data the only
collective of a call), then wire (the data that did not ride in the header, in one more collective).

Every rank sends a header row of the same width: ``width`` int64 words, the last one a 32-bit call tag over
32 bits of size, the others inline payload (the data itself when it fits: packing.py writes it). Width 1 is
exchanged by one int64 SUM all_reduce of ``group size`` words, each rank's word at its index and zeros
elsewhere, so the sum hands every rank every word bit for bit: an all_gather at the price of the cheapest
all_reduce (in gloo an all_reduce of at most one element per rank is one exchange; an all_gather or a longer
all_reduce costs about a third more). Its 4-byte payload is the low half of the word (one float32 0-d tensor,
say). Wider rows go by one all_gather. A group's width follows the largest payload of its last HISTORY calls,
which every rank of the group saw agree, so every rank picks the same width and the exchange always matches
up; every call of every kind starts with it, so one rank calling all_reduce while another calls all_gather
meets here and raises instead of hanging or mixing data.

The tag is a hash of the collective, its op, root and flags, the 128-bit digest of the collection's structure
and its fixed payload size (plans.call_tag): 0 is never sent by a fabriclite collective, 1 says "this rank
failed locally". The size is the rank's row length in UNIT-byte units. Equal tags on every rank: the call goes
on. Anything else (a local error, a different call, a different structure) sends every rank into one detailed
exchange of full call descriptions (an object all_gather, only on this path), after which every rank raises the
same ``CollectiveMismatchError``, and the group stays usable. Two different calls share a tag with probability
2**-32.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, NamedTuple, NoReturn, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from fabriclite.collectives.buffers import (HISTORY, POOL_MIN_LEAVES, UNIT, Message, Packed, Row, Slot, Words,
                                            pool_of)
from fabriclite.collectives.ops import BITWISE_OPS, OP_NAMES
from fabriclite.collectives.plans import (ALL_GATHER, ALL_REDUCE, BROADCAST, FLAG_CAT, GATHER, KIND_NAMES, REDUCE,
                                          Bucket, Call, GatherPlan, Plan)
from fabriclite.collectives.state import Context

TAG_NONE, TAG_ERROR = 0, 1
_MAX_LISTED = 8


class CollectiveMismatchError(ValueError):
    """The ranks disagreed (different collectives, ops, roots, structures or shapes) or one of them failed
    before any data moved. Raised with the same message on every rank of the group, which stays usable."""


# ---------------------------------------------------------------------------------------------- agree
def agree(ctx: Context, words: Words, tag: int, low: Optional[int], call: Call, lines: Optional[List[str]] = None,
          hint: str = "", during: Optional[Callable[[], None]] = None) -> List[int]:
    """Send this rank's header (``tag`` over ``low``: its row size in UNIT-byte units; or, at width 1 with
    ``low`` None, over the 4-byte payload already written) and return every rank's low half when every rank
    sent this tag (the group's next header width then follows from the sizes they carry); ``words.rows`` then
    holds every rank's payload. Otherwise raises the same CollectiveMismatchError on every rank, after one
    detailed exchange: a rank's local error, different collectives, ops, roots or flags, different structures
    (``lines``: this rank's structure lines) or payload sizes. ``during``: work that needs none of the exchanged
    data (finding a result buffer), run while the strategy moves it where the strategy can start the exchange
    and wait for it later (``flat_all_gather_into_async``: a wide header under DDP), else after it."""
    halves = _exchange(ctx, words, tag, low, during)
    tags = halves[1::2]
    first = tags[0]
    if first <= TAG_ERROR or tags.count(first) != len(tags):
        _disagree(ctx, tags, call, None, lines, hint)
    lows = halves[0::2]
    owner, need = words.owner, 1 + 2 * max(lows) if words.sized else 1
    need = need if need <= owner.limit else 1
    needs = owner.needs
    if not (need == needs[-1] and len(needs) == HISTORY and needs.count(need) == HISTORY):
        needs.append(need)  # else the same as the last HISTORY calls: the width stays
        width, most = 1, max(needs)
        while width < most:
            width *= 2
        owner.width = width
    return lows


def fail(ctx: Context, words: Words, call: Call, error: BaseException) -> NoReturn:
    """Report this rank's local ``error`` through the header exchange (``words``: this group's header, from
    packing.begin), so that every rank raises the same CollectiveMismatchError (here chained to ``error``)
    instead of the others waiting for this one."""
    halves = _exchange(ctx, words, TAG_ERROR, 0)
    try:
        _disagree(ctx, halves[1::2], call, f"{type(error).__name__}: {error}", None, "")
    except CollectiveMismatchError as mismatch:
        raise mismatch from error


def _exchange(ctx: Context, words: Words, tag: int, low: Optional[int],
              during: Optional[Callable[[], None]] = None) -> List[int]:
    """The header collective; every rank's halves, flat: ``[low_0, tag_0, low_1, tag_1, ...]``. ``during`` runs
    while the collective runs where the strategy can start it and wait later, else after it."""
    words.sized = low is not None
    j = 2 * (words.width - 1)
    halves = words.halves
    if halves is not None:
        halves[j + 1] = tag
        if low is not None:
            halves[j] = low
    else:
        pair = words.mine.view(torch.int32)
        pair[j + 1:j + 2].fill_(_signed(tag))
        if low is not None:
            pair[j:j + 1].fill_(_signed(low))
    start = getattr(ctx.strategy, "flat_all_gather_into_async", None) if during is not None else None
    if words.width == 1:
        result = ctx.strategy.flat_all_reduce(words.gathered, "sum", ctx.group)
    elif start is not None:
        finish = start(words.gathered, words.mine, ctx.group)
        try:
            during()  # type: ignore[misc]
        finally:  # the collective runs on: wait for it whatever ``during`` did
            result = finish()
        during = None
    else:
        result = ctx.strategy.flat_all_gather_into(words.gathered, words.mine, ctx.group)
    if during is not None:
        during()
    words.result = result
    if result is words.gathered:
        words.rows = words.own_rows
        if words.last_halves is not None:
            return words.last_halves.ravel().tolist()
    else:
        words.rows = result.reshape(words.size, words.width).view(torch.uint8)[:, :words.capacity]
    last = result.reshape(words.size, words.width)[:, -1].cpu().tolist()
    out: List[int] = []
    for value in last:
        value &= 0xFFFFFFFFFFFFFFFF
        out += (value & 0xFFFFFFFF, value >> 32)
    return out


def _signed(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


# ---------------------------------------------------------------------------------------------- wire
def wire_reduce(ctx: Context, plan: Plan, packed: Packed, finish: bool = True) -> List[Tuple[Any,
                                                                                                   Optional[Slot]]]:
    """A reduction's data reduced, per bucket ``(reduced buffer, slot)``; with ``finish`` (the result is wanted
    on this rank) a mean divided and in the result dtype. Inline (the rows rode in the header), every rank's row
    is reduced here, on every rank alike (numpy for the 0-d float and int buckets it reduces exactly as torch
    would: straight into the bucket's reused result buffer, its slot, from POOL_MIN_LEAVES leaves, else a new
    array); else one primitive all_reduce per wire buffer (in place; a pooled large tensor copied
    in by the strategy's all_reduce_copy, the copy overlapped with the reduction; the caller's own tensor,
    ``inplace``, divided the same way)."""
    out: List[Tuple[Any, Optional[Slot]]] = []
    size, mean = ctx.size, plan.op == "mean"
    words = packed.words
    if packed.inline:
        assert words is not None
        for k, bucket in enumerate(plan.buckets):
            divide = finish and mean and plan.divisors[k] is None
            values = _inline_numpy(bucket, words, plan.np_dtypes[k])
            if values is None:
                buf = _reduce_rows(_inline_rows(words.rows, bucket), plan.op)
                out.append((_finish(buf, bucket.result, size, divide) if finish else buf, None))
                continue
            ufunc, slot, target = plan.reduce_np, None, None
            if finish and bucket.scalar and len(bucket.ids) >= POOL_MIN_LEAVES:  # into a reused result buffer
                slot = pool_of(bucket, "flat").acquire((bucket.numel,), bucket.result, ctx.device)
                target = slot.numpy() if bucket.perm is None else _scratch(bucket, values.dtype)
            if len(values) == 2:  # one binary op costs less than a reduction
                values = ufunc(values[0], values[1]) if target is None else ufunc(values[0], values[1], out=target)
            else:  # numpy sums int32 as int64 otherwise
                values = ufunc.reduce(values, axis=0, dtype=values.dtype, out=target)
            if divide:
                values = values / size if target is None else np.divide(values, size, out=target)
            if slot is not None and bucket.perm is not None:  # to the caller's order (whole buckets only)
                values = np.take(values, bucket.inverse_np, out=slot.numpy())
            out.append((values, slot))
        return out
    for (buf, divided, slot, source), bucket in zip(packed.buffers, plan.buckets):
        if size > 1:
            flat = buf.view(-1)
            if source is not None:  # source may be buf itself (inplace): the copy is then the division alone
                result = ctx.strategy.flat_all_reduce_copy(flat, source.reshape(-1), plan.primitive, ctx.group,
                                                           size if divided else None)
            else:
                result = ctx.strategy.flat_all_reduce(flat, plan.primitive, ctx.group)
            buf, slot = (buf, slot) if result is flat else (result.view(buf.shape), None)
        out.append((_finish(buf, bucket.result, size, mean and not divided) if finish else buf, slot))
    return out


def _scratch(bucket: Bucket, dtype: Any) -> Any:
    """A numpy vector of the bucket's length, kept on the bucket, never handed out."""
    scratch = bucket.cache.get("scratch")
    if scratch is None or scratch.dtype != dtype:
        scratch = bucket.cache["scratch"] = np.empty(bucket.numel, dtype=dtype)
    return scratch


def _finish(reduced: Tensor, result: torch.dtype, size: int, divide: bool) -> Tensor:
    """``reduced`` as the caller sees it: divided by ``size`` (a mean not divided before the sum), cast to
    the ``result`` dtype. May reuse ``reduced``."""
    if divide:
        if reduced.dtype == result and (reduced.is_floating_point() or reduced.is_complex()):
            return reduced.div_(size)
        return torch.div(reduced, size).to(result)
    if reduced.dtype != result:
        return reduced.to(result)
    return reduced


def _inline_numpy(bucket: Bucket, words: Words, np_dtype: Any) -> Optional[Any]:
    """The ``(size, numel)`` numpy view of the bucket in every rank's inline row, when it is reduced with numpy
    (``np_dtype``; a CPU header the strategy exchanged in place), made once per bucket and header; else None."""
    if np_dtype is None or words.numpy is None or words.result is not words.gathered:
        return None
    key = ("inline numpy", id(words))
    cached = bucket.cache.get(key)
    if cached is None or cached[0] is not words:
        raw = words.numpy.view(np.uint8)[:, :words.capacity]
        cached = bucket.cache[key] = (words, raw[:, bucket.offset:bucket.offset + bucket.nbytes].view(np_dtype))
    return cached[1]


def _inline_rows(rows: Tensor, bucket: Bucket) -> Tensor:
    """``(size, bucket.numel)`` typed view of the bucket in the header's reused ``rows``, made once per rows."""
    cached = bucket.cache.get("inline rows")
    if cached is None or cached[0] is not rows:
        cached = bucket.cache["inline rows"] = (rows, _bucket_rows(rows, bucket))
    return cached[1]


def _bucket_rows(rows: Tensor, bucket: Bucket) -> Tensor:
    """``(size, bucket.numel)`` typed view of the bucket's bytes in every row of ``rows`` (uint8)."""
    return rows[:, bucket.offset:bucket.offset + bucket.nbytes].view(bucket.wire)


def _reduce_rows(rows: Tensor, op: str) -> Tensor:
    """``rows`` ``(group_size, n)`` of one wire dtype reduced over dim 0, exactly as the primitive would (a
    mean: the sum, divided when unpacking). The same rows give the same result on every rank."""
    if op in ("sum", "mean"):
        return rows.sum(0, dtype=rows.dtype)
    if op == "min":
        return rows.amin(0)
    if op == "max":
        return rows.amax(0)
    if op == "prod":
        return rows.prod(0, dtype=rows.dtype)
    return functools.reduce(BITWISE_OPS[op], rows.unbind(0))


class Gathered(NamedTuple):
    """Every rank's all_gather row: ``rows`` ``(size, L)`` uint8 and, per fixed bucket, ``regions``: its typed
    ``(size, numel)`` view of them; or the pool ``slot`` one large tensor was gathered into."""

    rows: Optional[Tensor]
    regions: List[Tensor]
    slot: Optional[Slot] = None


def wire_rows(ctx: Context, plan: GatherPlan, row: Row, lows: Optional[List[int]]) -> Gathered:
    """An all_gather's rows: the header's rows when every row rode inline, else one primitive all_gather of
    rows padded to the longest (``lows``: every rank's length, from ``agree``; without a header, every row is
    as long as this one), one large tensor into a reused output buffer (warm memory, no page faults)."""
    buckets, words = plan.layout.buckets, row.words
    if words is not None and lows is not None and words.width == 1 and row.inline:  # a fixed row, every rank's
        return Gathered(words.rows, [_inline_rows(words.rows, b) for b in buckets])
    longest = row.low * UNIT  # this row's length, padded (every row's, without a header)
    if ctx.size == 1:
        rows = _assemble(row.parts, longest, ctx.device).view(1, -1)
        return Gathered(rows, [_bucket_rows(rows, b) for b in buckets])
    if words is not None and lows is not None:
        longest = max(lows) * UNIT
        if words.width > 1 and longest <= words.room:
            return Gathered(words.rows, [_inline_rows(words.rows, b) for b in buckets])
        if row.inline:  # another rank's row did not fit: send this one again, from the header's payload
            row.parts = [(0, words.payload[:row.length])]
    mine = _assemble(row.parts, longest, ctx.device)
    if row.slot is not None:
        ctx.strategy.flat_all_gather_into(row.slot.buffer.view(torch.uint8).view(ctx.size, longest), mine, ctx.group)
        row.slot.commit()
        return Gathered(None, [], row.slot)
    rows = ctx.strategy.flat_all_gather(mine, ctx.group)
    return Gathered(rows, [_bucket_rows(rows, b) for b in buckets])


def wire_message(ctx: Context, msg: Message, src: int, src_index: int,
                 lows: Optional[List[int]]) -> Optional[Tuple[Optional[bytes], Tensor]]:
    """A broadcast's message from ``src``: on ``src`` None (it sent it); elsewhere ``(skeleton, data)``:
    ``src``'s row of the header when it rode there, else one primitive broadcast (skeleton None: ``data`` is
    the whole message); without a header, the skeleton as an object broadcast, then the tensors' bytes."""
    is_src, words = ctx.index == src_index, msg.words
    if words is None or lows is None:
        is_src = ctx.strategy.global_rank == src
        skeleton, nbytes = ctx.strategy.broadcast_object((msg.skeleton, msg.nbytes), src, ctx.group)
        if is_src:
            if nbytes:
                ctx.strategy.flat_broadcast(_assemble(msg.parts, nbytes, ctx.device), src, ctx.group)
            return None
        data = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device)
        return skeleton, ctx.strategy.flat_broadcast(data, src, ctx.group) if nbytes else data
    length = lows[src_index] * UNIT
    if words.width > 1 and length <= words.room:
        return None if is_src else (None, words.rows[src_index, :length].clone())
    if is_src:
        ctx.strategy.flat_broadcast(_assemble(msg.message, length, ctx.device), src, ctx.group)
        return None
    data = torch.empty(length, dtype=torch.uint8, device=ctx.device)
    return None, ctx.strategy.flat_broadcast(data, src, ctx.group)


def _assemble(parts: List[Tuple[int, Tensor]], length: int, device: torch.device) -> Tensor:
    """One uint8 row of ``length`` bytes holding ``parts`` ((offset, uint8 tensor)); the part itself when
    it is the whole row (no copy)."""
    if len(parts) == 1 and parts[0][0] == 0 and parts[0][1].numel() == length and parts[0][1].device == device:
        return parts[0][1]
    row = torch.empty(length, dtype=torch.uint8, device=device)
    for offset, part in parts:
        row[offset:offset + part.numel()].copy_(part)
    return row


# ---------------------------------------------------------------------------------------------- disagreement
def _disagree(ctx: Context, tags: List[int], call: Call, error: Optional[str], lines: Optional[List[str]],
              hint: str) -> NoReturn:
    ranks = ctx.ranks
    silent = [ranks[r] for r, t in enumerate(tags) if t == TAG_NONE]
    if silent:  # such a rank is not in this code: no further exchange with it
        raise CollectiveMismatchError(
            f"ranks {silent} sent no fabriclite collective header: every rank must call the same "
            "fabriclite collective at this point (not torch.distributed directly), with the same fabriclite version.")
    mine = (tuple(call), error, lines if lines is not None and error is None else [])
    infos = [(Call(*c), e, l) for c, e, l in ctx.strategy.all_gather_object(mine, ctx.group)]
    raise CollectiveMismatchError(_explain(ctx, infos, hint))


def _explain(ctx: Context, infos: List[Tuple[Call, Optional[str], List[str]]], hint: str) -> str:
    ranks = ctx.ranks
    calls = [c for c, _, _ in infos]
    failed = [r for r, (_, e, _) in enumerate(infos) if e is not None]
    if failed:
        texts = "; ".join(f"rank {ranks[r]}: {infos[r][1]}" for r in failed)
        kind = KIND_NAMES.get(calls[failed[0]].kind, "collective")
        return (f"{kind} failed before any data moved, on rank{'s' if len(failed) > 1 else ''} "
                f"{[ranks[r] for r in failed]}: {texts}")
    first = calls[0]
    if any(c[:4] != first[:4] for c in calls):
        listed = "; ".join(f"rank {rank}: {describe_call(c)}" for rank, c in zip(ranks, calls))
        return (f"the ranks called different collectives at this point ({listed}); every rank of the group must "
                "make the same collective calls, with the same arguments, in the same order.")
    if any(c.digest != first.digest for c in calls):
        return _structure_diff(ctx, first.kind, [lines for _, _, lines in infos], hint)
    if any(c.fixed != first.fixed for c in calls):
        return (f"{KIND_NAMES.get(first.kind)}: ranks disagree on the payload size "
                f"({[c.fixed for c in calls]} bytes).")
    return ("the ranks' collective headers differ though their calls agree: every rank must run the same "
            "fabriclite version.")


def describe_call(call: Call) -> str:
    """``all_reduce(reduce_op='sum')``, ``broadcast(src=1)``, ``all_gather(cat=True)``, ... for messages."""
    kind = call.kind
    name = KIND_NAMES.get(kind, f"<unknown collective {kind}>")
    args = []
    if kind in (ALL_REDUCE, REDUCE):
        args.append(f"reduce_op={OP_NAMES.get(call.op, '?')!r}")
    if kind == BROADCAST:
        args.append(f"src={call.root}")
    if kind in (GATHER, REDUCE):
        args.append(f"dst={call.root}")
    if kind == ALL_GATHER:
        args.append(f"cat={bool(call.flags & FLAG_CAT)}")
    return f"{name}({', '.join(args)})"


def _structure_diff(ctx: Context, kind: int, lines: List[List[str]], hint: str) -> str:
    ranks = ctx.ranks
    per_rank: List[Dict[str, str]] = [dict(line.split(": ", 1) for line in rank_lines) for rank_lines in lines]
    paths: List[str] = []
    seen = set()
    for rank_map in per_rank:
        for path in rank_map:
            if path not in seen:
                seen.add(path)
                paths.append(path)
    problems = []
    for path in paths:
        have = [r for r, m in enumerate(per_rank) if path in m]
        if len(have) < len(per_rank):
            missing = [ranks[r] for r in range(len(per_rank)) if r not in have]
            problems.append(f"{path} is on ranks {[ranks[r] for r in have]} but not on ranks {missing}")
            continue
        descs = [m[path] for m in per_rank]
        if len(set(descs)) > 1:
            problems.append(f"{path}: " + ", ".join(f"rank {ranks[r]} has a {d}" for r, d in enumerate(descs)))
    if not problems:
        problems.append("the leaves are the same but in a different order")
    more = f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
    name = KIND_NAMES.get(kind, "collective")
    return (f"{name}: the ranks' collections differ: " + "; ".join(problems[:_MAX_LISTED]) + more +
            f". Every rank must pass the same keys (insertion order does not matter), container kinds, dtypes "
            f"and shapes{hint}.")
