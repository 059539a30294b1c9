"""The agreement header: the first (and for small payloads the only) collective of every call.

Every rank sends a fixed-size int64 header whatever it holds (so the exchange itself always matches up):
the protocol magic, the collective's kind, its op and root, flags, a 128-bit structure digest, byte counts
and an inline payload (the data itself when it is small, or this rank's local error text). Every rank then
decides from the same gathered headers, so a mismatch raises the same ``CollectiveMismatchError`` on every
rank before any data moves, and the group stays usable.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NoReturn, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fabriclite.collectives import ops
from fabriclite.collectives.state import Context

MAGIC = 0x464C4331  # "FLC1": fabriclite collectives, protocol 1
#: meta word positions; every rank must send the same words up to W_FIXED
(W_MAGIC, W_KIND, W_OP, W_ROOT, W_FLAGS, W_DIGEST0, W_DIGEST1, W_FIXED, W_NBYTES, W_INLINE, W_AUX, W_ERROR) = range(12)
META_WORDS = 16
META_BYTES = META_WORDS * 8

BARRIER, BROADCAST, ALL_REDUCE, ALL_GATHER, GATHER, REDUCE = range(1, 7)
KIND_NAMES = {BARRIER: "barrier", BROADCAST: "broadcast", ALL_REDUCE: "all_reduce", ALL_GATHER: "all_gather",
              GATHER: "gather", REDUCE: "reduce"}
FLAG_CAT = 1
_MAX_LISTED = 8


class CollectiveMismatchError(ValueError):
    """The ranks disagreed (different collectives, ops, roots, structures or shapes) or one of them failed
    before any data moved. Raised with the same message on every rank of the group, which stays usable."""


def capacity(size: int) -> int:
    """Inline payload bytes per rank for a group of ``size``: 8 KiB for small groups, shrinking so the
    gathered headers stay near 32 KiB, never below 256 bytes."""
    return max(256, min(8192, (32768 // max(size, 1)) // 16 * 16))


def header_words(size: int) -> int:
    return META_WORDS + capacity(size) // 8


class _HeaderBuffer:
    """This rank's header (int64) and the gathered headers, reused across calls (nothing handed to a caller
    is a view of them): the header's payload region as a uint8 tensor and (CPU) a numpy array over the
    same memory."""

    def __init__(self, size: int, device: torch.device) -> None:
        words = header_words(size)
        self.words = torch.zeros(words, dtype=torch.int64, device=device)
        self.gathered = torch.zeros((size, words), dtype=torch.int64, device=device)
        self.numpy = self.words.numpy() if self.words.device.type == "cpu" else None
        self.payload = self.words.view(torch.uint8)[META_BYTES:]
        self.payload_np = self.numpy.view("uint8")[META_BYTES:] if self.numpy is not None else None


def _buffer(ctx: Context) -> _HeaderBuffer:
    key = (ctx.size, ctx.device)
    entry = ctx.state.headers.get(key)
    if entry is None:
        entry = ctx.state.headers[key] = _HeaderBuffer(ctx.size, ctx.device)
    return entry


def payload(ctx: Context) -> Tuple[Tensor, Optional[Any]]:
    """This rank's inline payload region (``capacity`` bytes) of its header buffer, as a uint8 tensor and,
    on CPU, the same memory as a numpy array (else None); write it before ``exchange``."""
    entry = _buffer(ctx)
    return entry.payload, entry.payload_np


def exchange(ctx: Context, words: Sequence[int], parts: Sequence[Tuple[int, Tensor]] = ()) -> Tensor:
    """Gather every rank's header: ``words`` (the meta words, at most META_WORDS) and ``parts`` ((byte
    offset, uint8 tensor) pieces of this rank's inline payload). Returns ``(size, header_words)`` int64."""
    entry = _buffer(ctx)
    if entry.numpy is not None:
        entry.numpy[: len(words)] = words
    else:
        entry.words[: len(words)].copy_(torch.tensor(words, dtype=torch.int64))
    for offset, part in parts:
        entry.payload[offset:offset + part.numel()].copy_(part)
    return ctx.strategy.all_gather_into(entry.gathered, entry.words, ctx.group)


def meta(gathered: Tensor) -> List[List[int]]:
    if gathered.device.type == "cpu":
        return gathered.numpy()[:, :META_WORDS].tolist()
    return gathered[:, :META_WORDS].tolist()


def payload_rows(gathered: Tensor, nbytes: int) -> Tensor:
    """``(size, nbytes)`` uint8 view of every rank's inline payload."""
    return gathered.view(torch.uint8)[:, META_BYTES:META_BYTES + nbytes]


def bytes_tensor(raw: bytes, device: torch.device) -> Tensor:
    """``raw`` as a uint8 tensor on ``device``."""
    if not raw:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def fail(ctx: Context, kind: int, error: BaseException, root: int = -1, flags: int = 0) -> NoReturn:
    """Report this rank's local ``error`` through the header exchange, so that every rank raises the same
    CollectiveMismatchError (here chained to ``error``) instead of the others waiting for this one."""
    text = f"{type(error).__name__}: {error}".encode("utf-8", "replace")[: capacity(ctx.size)] or b"?"
    gathered = exchange(ctx, call_words(kind, root=root, flags=flags, error=len(text)),
                        [(0, bytes_tensor(text, ctx.device))])
    try:
        agree(ctx, gathered)
    except CollectiveMismatchError as mismatch:
        raise mismatch from error
    raise AssertionError("agree() raises for a local error")  # pragma: no cover


def call_words(kind: int, op: int = 0, root: int = -1, flags: int = 0, digest: Tuple[int, int] = (0, 0),
               fixed: int = 0, nbytes: int = 0, inline: int = 0, aux: int = 0, error: int = 0) -> List[int]:
    return [MAGIC, kind, op, root, flags, digest[0], digest[1], fixed, nbytes, inline, aux, error]


# ---------------------------------------------------------------------------------------------- agreement
def agree(ctx: Context, gathered: Tensor, describe: Optional[Callable[[], List[str]]] = None,
          hint: str = "") -> List[List[int]]:
    """Check the gathered headers; return every rank's meta words. Raises CollectiveMismatchError (the same
    on every rank) when a rank reported a local error, or the ranks called different collectives, ops,
    roots or flags, or their structures differ (``describe`` gives this rank's structure lines for the
    message; exchanged only on that path)."""
    rows = meta(gathered)
    first = rows[0]
    agreed = first[: W_FIXED + 1]
    if first[W_MAGIC] == MAGIC and all(row[: W_FIXED + 1] == agreed and not row[W_ERROR] for row in rows):
        return rows  # the common case: every agreed word equal, no local error
    bad_magic = [r for r, row in enumerate(rows) if row[W_MAGIC] != MAGIC]
    if bad_magic:
        raise CollectiveMismatchError(
            f"ranks {_global(ctx, bad_magic)} sent no fabriclite collective header: every rank must call the same "
            "fabriclite collective at this point (not torch.distributed directly), with the same fabriclite version.")
    failed = [r for r, row in enumerate(rows) if row[W_ERROR]]
    if failed:
        raise CollectiveMismatchError(_local_errors(ctx, gathered, rows, failed))
    for word, what in ((W_KIND, "collective"), (W_OP, "reduce_op"), (W_ROOT, "root"), (W_FLAGS, "cat")):
        if any(row[word] != first[word] for row in rows):
            raise CollectiveMismatchError(_different_calls(ctx, rows, what))
    if any(row[W_DIGEST0] != first[W_DIGEST0] or row[W_DIGEST1] != first[W_DIGEST1] for row in rows):
        lines = ctx.strategy.all_gather_object(describe() if describe else [], ctx.group)
        raise CollectiveMismatchError(_structure_diff(ctx, first[W_KIND], lines, hint))
    if any(row[W_FIXED] != first[W_FIXED] for row in rows):
        raise CollectiveMismatchError(f"{KIND_NAMES.get(first[W_KIND])}: ranks disagree on the payload size "
                                      f"({[row[W_FIXED] for row in rows]} bytes).")
    return rows


def _global(ctx: Context, indices: Sequence[int]) -> List[int]:
    ranks = ctx.ranks
    return [ranks[i] for i in indices]


def _local_errors(ctx: Context, gathered: Tensor, rows: List[List[int]], failed: List[int]) -> str:
    texts = []
    data = gathered.view(torch.uint8)
    for r in failed:
        n = rows[r][W_ERROR]
        raw = bytes(data[r, META_BYTES:META_BYTES + n].cpu().tolist())
        texts.append(f"rank {ctx.ranks[r]}: {raw.decode('utf-8', 'replace')}")
    kind = KIND_NAMES.get(rows[failed[0]][W_KIND], "collective")
    return (f"{kind} failed before any data moved, on rank{'s' if len(failed) > 1 else ''} "
            f"{_global(ctx, failed)}: " + "; ".join(texts))


def describe_call(row: List[int]) -> str:
    """``all_reduce(reduce_op='sum')``, ``broadcast(src=1)``, ``all_gather(cat=True)``, ... for messages."""
    kind = row[W_KIND]
    name = KIND_NAMES.get(kind, f"<unknown collective {kind}>")
    args = []
    if kind in (ALL_REDUCE, REDUCE):
        args.append(f"reduce_op={ops.OP_NAMES.get(row[W_OP], '?')!r}")
    if kind == BROADCAST:
        args.append(f"src={row[W_ROOT]}")
    if kind in (GATHER, REDUCE):
        args.append(f"dst={row[W_ROOT]}")
    if kind == ALL_GATHER:
        args.append(f"cat={bool(row[W_FLAGS] & FLAG_CAT)}")
    return f"{name}({', '.join(args)})"


def _different_calls(ctx: Context, rows: List[List[int]], what: str) -> str:
    calls = [describe_call(row) for row in rows]
    listed = "; ".join(f"rank {rank}: {call}" for rank, call in zip(ctx.ranks, calls))
    return (f"the ranks called different collectives at this point ({listed}); every rank of the group must "
            "make the same collective calls, with the same arguments, in the same order.")


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
