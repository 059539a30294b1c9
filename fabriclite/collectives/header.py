"""The agreement header: the first (and for small data the only) collective of every call.

Every rank sends a header row of the same width: ``width`` int64 words, the last one a 32-bit call tag
over 32 bits of size, the others inline payload (the data itself when it fits). Width 1 is exchanged by
one int64 SUM all_reduce of ``group size`` words, each rank's word at its index and zeros elsewhere, so
the sum hands every rank every word bit for bit: an all_gather at the price of the cheapest all_reduce
(in gloo an all_reduce of at most one element per rank is one exchange; an all_gather or a longer
all_reduce costs about a third more). Its 4-byte payload is the low half of the word (one float32 0-d
tensor, say). Wider rows go by one all_gather. A group's width follows the largest payload of its last
HISTORY calls, which every rank of the group saw agree, so every rank picks the same width and the
exchange always matches up; every call of every kind starts with it, so one rank calling all_reduce
while another calls all_gather meets here and raises instead of hanging or mixing data.

The tag is a hash of the collective, its op, root and flags, the 128-bit digest of the collection's
structure and its fixed payload size: 0 is never sent by a fabriclite collective, 1 says "this rank
failed locally". The size is the rank's row length in UNIT-byte units. Equal tags on every rank: the call
goes on. Anything else (a local error, a different call, a different structure) sends every rank into one
detailed exchange of full call descriptions (an object all_gather, only on this path), after which every
rank raises the same ``CollectiveMismatchError``, and the group stays usable. Two different calls share a
tag with probability 2**-32.
"""
from __future__ import annotations

import hashlib
import struct
from collections import deque
from typing import Callable, Deque, Dict, List, NamedTuple, NoReturn, Optional, Tuple

import torch
from torch import Tensor

from fabriclite.collectives import ops
from fabriclite.collectives.state import Context

MAGIC = 0x464C4332  # "FLC2": fabriclite collectives, protocol 2
TAG_NONE, TAG_ERROR = 0, 1
#: inline payload bytes per rank at width 1 (the low half of its word)
CAPACITY = 4
#: sizes travel in units of UNIT bytes, so 32 bits cover 64 GiB
UNIT = 16
MAX_SIZE = (1 << 32) - 1

BARRIER, BROADCAST, ALL_REDUCE, ALL_GATHER, GATHER, REDUCE = range(1, 7)
KIND_NAMES = {BARRIER: "barrier", BROADCAST: "broadcast", ALL_REDUCE: "all_reduce", ALL_GATHER: "all_gather",
              GATHER: "gather", REDUCE: "reduce"}
FLAG_CAT = 1
_MAX_LISTED = 8
_PACK = struct.Struct("<8q")


class CollectiveMismatchError(ValueError):
    """The ranks disagreed (different collectives, ops, roots, structures or shapes) or one of them failed
    before any data moved. Raised with the same message on every rank of the group, which stays usable."""


class Call(NamedTuple):
    """What every rank of one collective call must agree on."""

    kind: int
    op: int = 0
    root: int = -1
    flags: int = 0
    digest: Tuple[int, int] = (0, 0)
    fixed: int = 0


def units(nbytes: int) -> int:
    """``nbytes`` in UNIT-byte units, rounded up; ValueError beyond what a header word carries."""
    n = -(-nbytes // UNIT)
    if n > MAX_SIZE:
        raise ValueError(f"{nbytes} bytes from one rank in one call is more than a collective carries "
                         f"({MAX_SIZE * UNIT} bytes); split the data over several calls.")
    return n


#: a group's header row widths: 1 word (the all_reduce form) up to MAX_WIDTH words per rank
MAX_WIDTH = 1024
#: the width follows the largest payload of the group's last HISTORY calls
HISTORY = 8


def max_width(size: int) -> int:
    """The widest header row for a group of ``size``: 8 KiB for small groups, shrinking so the exchanged
    headers stay near 32 KiB; a power of two, at least 2."""
    width = 2
    while width * 2 <= min(MAX_WIDTH, 4096 // max(size, 1)):
        width *= 2
    return width


class Words:
    """One header buffer of a group on this rank, reused across calls: ``width`` int64 words per rank,
    this rank's inline ``payload`` region (``capacity`` bytes, uint8; ``payload_np``: the same memory as a
    numpy array on CPU, else None) and, after an exchange, ``rows()``: every rank's payload. Width 1 is
    exchanged by an int64 SUM all_reduce (this rank's word at its index, zeros elsewhere), wider rows by an
    all_gather. Nothing handed to a caller is a view of it."""

    def __init__(self, owner: "Header", width: int) -> None:
        size, index, device = owner.size, owner.index, owner.device
        self.owner, self.width, self.size = owner, width, size
        self.capacity = CAPACITY if width == 1 else 8 * (width - 1)
        self.gathered = torch.zeros((size, width), dtype=torch.int64, device=device)
        self.mine = self.gathered[index] if width == 1 else torch.zeros(width, dtype=torch.int64, device=device)
        self.payload = self.mine.view(torch.uint8)[:self.capacity]
        self._rows = self.gathered.view(torch.uint8)[:, :self.capacity]
        self.result = self.gathered
        self.sized = False
        cpu = self.gathered.device.type == "cpu"
        self.numpy = self.gathered.numpy() if cpu else None
        mine_np = self.mine.numpy() if cpu else None
        self.halves = mine_np.view("uint32") if mine_np is not None else None
        #: every rank's last word as (low, tag) uint32 pairs, read straight from the exchanged buffer
        self.last_halves = self.numpy[:, -1:].view("uint32") if self.numpy is not None else None
        self.payload_np = mine_np.view("uint8")[:self.capacity] if mine_np is not None else None

    def fits(self, nbytes: int) -> bool:
        """Whether a row of ``nbytes`` rides inline (the same answer on every rank for the same length)."""
        if self.width == 1:
            return nbytes <= CAPACITY
        return units(nbytes) * UNIT <= self.capacity

    def rows(self) -> Tensor:
        """Every rank's inline payload after ``exchange``: ``(size, capacity)`` uint8."""
        if self.result is self.gathered:
            return self._rows
        return self.result.reshape(self.size, self.width).view(torch.uint8)[:, :self.capacity]

    def clear(self) -> "Words":
        """Zero the words (the all_reduce form needs every other rank's word zero)."""
        if self.width == 1:
            if self.numpy is not None:
                self.numpy[:] = 0
            else:
                self.gathered.zero_()
        return self


class Header:
    """The header of one group on this rank: its buffers by width and the recent payload sizes that set
    the next call's width. Every rank of the group sees the same calls agree, so every rank computes the
    same width for the next call: the exchange always matches up."""

    def __init__(self, size: int, index: int, device: torch.device) -> None:
        self.size, self.index, self.device = size, index, device
        self.limit = max_width(size)
        self.needs: Deque[int] = deque([1], maxlen=HISTORY)
        self.width = 1
        self.buffers: Dict[int, Words] = {}

    def words(self) -> Words:
        words = self.buffers.get(self.width)
        if words is None:
            words = self.buffers[self.width] = Words(self, self.width)
        return words

    def record(self, need: int) -> None:
        """An agreed call whose rows needed ``need`` words to ride inline."""
        need = need if need <= self.limit else 1
        needs = self.needs
        if need == needs[-1] and len(needs) == HISTORY and needs.count(need) == HISTORY:
            return  # the same as the last HISTORY calls: the width stays
        needs.append(need)
        width, most = 1, max(self.needs)
        while width < most:
            width *= 2
        self.width = width


def begin(ctx: Context) -> Words:
    """This group's header buffer for the next call, cleared: write this rank's inline payload into it
    (when ``fits``), then ``exchange``."""
    state = ctx.header
    if state is None:
        key = (ctx.group, ctx.device)
        state = ctx.state.headers.get(key)
        if state is None:
            state = ctx.state.headers[key] = Header(ctx.size, ctx.index, ctx.device)
        ctx.header = state
    return state.words().clear()


def call_tag(call: Call) -> int:
    """The 32-bit tag of ``call``: never TAG_NONE or TAG_ERROR, the same in every process."""
    raw = hashlib.blake2b(_PACK.pack(MAGIC, call.kind, call.op, call.root, call.flags, call.digest[0],
                                     call.digest[1], call.fixed), digest_size=8).digest()
    return int.from_bytes(raw, "little") % (MAX_SIZE - 1) + 2


def tag(ctx: Context, call: Call) -> int:
    """``call_tag(call)``, remembered per strategy."""
    tags = ctx.state.tags
    value = tags.get(call)
    if value is None:
        value = tags[call] = call_tag(call)
    return value


def exchange(ctx: Context, words: Words, tag_value: int, low: Optional[int] = None) -> List[int]:
    """Send this rank's header (``tag_value`` over ``low``: a size in UNIT-byte units; or, at width 1
    with ``low`` None, over the 4-byte payload already written) and return every rank's halves, flat:
    ``[low_0, tag_0, low_1, tag_1, ...]``; ``words.rows()`` then holds every rank's payload."""
    words.sized = low is not None
    j = 2 * (words.width - 1)
    halves = words.halves
    if halves is not None:
        halves[j + 1] = tag_value
        if low is not None:
            halves[j] = low
    else:
        pair = words.mine.view(torch.int32)
        pair[j + 1:j + 2].fill_(_signed(tag_value))
        if low is not None:
            pair[j:j + 1].fill_(_signed(low))
    if words.width == 1:
        result = ctx.strategy.flat_all_reduce(words.gathered, "sum", ctx.group)
    else:
        result = ctx.strategy.flat_all_gather_into(words.gathered, words.mine, ctx.group)
    words.result = result
    if words.last_halves is not None and result is words.gathered:
        return words.last_halves.ravel().tolist()
    else:
        last = result.reshape(words.size, words.width)[:, -1].cpu().tolist()
    out: List[int] = []
    for value in last:
        value &= 0xFFFFFFFFFFFFFFFF
        out += (value & 0xFFFFFFFF, value >> 32)
    return out


def _signed(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def agree(ctx: Context, words: Words, halves: List[int], call: Call,
          describe: Optional[Callable[[], List[str]]] = None, hint: str = "") -> List[int]:
    """Every rank's low half when every rank sent this ``call``'s tag (the group's next header width then
    follows from the sizes they carry). Otherwise raises the same CollectiveMismatchError on every rank,
    after one detailed exchange: a rank's local error, different collectives, ops, roots or flags,
    different structures (``describe``: this rank's structure lines) or payload sizes."""
    tags = halves[1::2]
    first = tags[0]
    if first > TAG_ERROR and tags.count(first) == len(tags):
        lows = halves[0::2]
        words.owner.record(1 + 2 * max(lows) if words.sized else 1)
        return lows
    _disagree(ctx, tags, call, None, describe, hint)


def fail(ctx: Context, call: Call, error: BaseException) -> NoReturn:
    """Report this rank's local ``error`` through the header exchange, so that every rank raises the same
    CollectiveMismatchError (here chained to ``error``) instead of the others waiting for this one."""
    halves = exchange(ctx, begin(ctx), TAG_ERROR, 0)
    try:
        _disagree(ctx, halves[1::2], call, f"{type(error).__name__}: {error}", None, "")
    except CollectiveMismatchError as mismatch:
        raise mismatch from error


# ---------------------------------------------------------------------------------------------- disagreement
def _disagree(ctx: Context, tags: List[int], call: Call, error: Optional[str],
              describe: Optional[Callable[[], List[str]]], hint: str) -> NoReturn:
    ranks = ctx.ranks
    silent = [ranks[r] for r, t in enumerate(tags) if t == TAG_NONE]
    if silent:  # such a rank is not in this code: no further exchange with it
        raise CollectiveMismatchError(
            f"ranks {silent} sent no fabriclite collective header: every rank must call the same "
            "fabriclite collective at this point (not torch.distributed directly), with the same fabriclite version.")
    try:
        lines = describe() if describe is not None and error is None else []
    except Exception as err:  # pragma: no cover - describing never fails for a collection that was walked
        lines, error = [], f"{type(err).__name__}: {err}"
    mine = (tuple(call), error, lines)
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
        args.append(f"reduce_op={ops.OP_NAMES.get(call.op, '?')!r}")
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


def bytes_tensor(raw: bytes, device: torch.device) -> Tensor:
    """``raw`` as a uint8 tensor on ``device``."""
    if not raw:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
