"""What the stages share, below all of them: the header buffers (``Words``, ``Header``) and their sizes, the
records one stage hands the next (``Packed``, ``Row``, ``Message``), and the reusable result buffers
(``Pool``, ``Slot``). The stages run structure -> plans -> packing -> header -> unpacking, and each imports only
the stages before it (tests/unit/collectives/test_stage_order.py); this module imports none of them.
"""
from __future__ import annotations

import operator
import sys
from collections import deque
from typing import Any, Callable, Deque, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

_use_count = getattr(torch._C, "_storage_Use_Count", None)
_requires_grad = operator.attrgetter("requires_grad")
try:  # torch's check of compiled code's tensor arguments: one C++ pass over many tensors
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - a torch without it: the checks run as Python passes
    _TensorGuards = None

#: inline payload bytes per rank at width 1 (the low half of its word)
CAPACITY = 4
#: sizes travel in units of UNIT bytes, so 32 bits (plans.MAX_SIZE) cover 64 GiB
UNIT = 16
#: a group's header row widths: 1 word (the all_reduce form) up to MAX_WIDTH words per rank
MAX_WIDTH = 1024
#: the width follows the largest payload of the group's last HISTORY calls
HISTORY = 8
POOL_DEPTH = 3
#: buckets with fewer 0-d leaves than this just unbind (a few new tensors cost less than the checks)
POOL_MIN_LEAVES = 8
#: single tensors at least this large reuse their wire buffer
POOL_MIN_BYTES = 1 << 16
#: results of a bucket larger than this are copied out leaf by leaf, so one kept leaf does not pin the bucket
DETACH_BYTES = 1 << 20
#: where the skeleton starts in a broadcast message (after its int64 length)
SKELETON_AT = 16
Views = Callable[[Tensor], Sequence[Tensor]]


def tensor_check(tensors: Sequence[Tensor], sizes: bool = True) -> Optional[Callable[..., bool]]:
    """A check, ``check(*others)``, that ``others`` are one by one of the Python type, dtype, device, number of
    dims, sizes and strides (with ``sizes``), ``requires_grad`` and dispatch keys (conjugate and negative bits,
    inference) that ``tensors`` have now, as one C++ pass (torch's guard on compiled code's tensor arguments,
    ``TensorGuards``: 30 ns a 0-d tensor, 45-55 ns a 1-d one, against 40-50 ns for each property read in a
    Python pass); False for a non-tensor. The thread's dispatch state at the check (inference mode) must be
    the one at this call, else the check fails (it never passes wrongly). None where torch has no such check:
    check in Python then."""
    if _TensorGuards is None:
        return None
    try:
        if sizes:
            return _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
        dims = [[None] * t.dim() for t in tensors]
        return _TensorGuards(*tensors, dynamic_dims_sizes=dims, dynamic_dims_strides=dims).check
    except Exception:  # pragma: no cover - a torch whose guard takes other arguments
        return None


# ---------------------------------------------------------------------------------------------- pool
class Slot:
    """One buffer and the views of it handed out; ``commit`` after writing to it."""

    def __init__(self, buffer: Tensor, make_views: Views) -> None:
        self.buffer = buffer
        self.views = tuple(make_views(buffer))
        #: of a slot kept in a pool, made by ``Pool._keep`` from the views as made (none requires grad): ``free``
        #: checks each still is so, in one C++ pass (their number of dims, not their sizes: a view's sizes change
        #: only with its number of dims); None: a Python pass over ``requires_grad``
        self.check: Optional[Callable[..., bool]] = None
        #: the buffer as a numpy array (CPU), made on first use and kept: one more user of the memory
        self.array: Any = None
        self.commit()

    def numpy(self) -> Any:
        """The buffer (on the CPU) as a numpy array sharing its memory, made once."""
        if self.array is None:
            self.array = self.buffer.numpy()
            self.uses += 1
        return self.array

    def _uses(self) -> int:
        return int(_use_count(self.buffer.untyped_storage()._cdata)) if _use_count is not None else -1

    def commit(self) -> None:
        """Record the buffer's state as handed out (after the last write to it). The memory's expected
        users are the buffer, its views and the storage handle ``_uses`` makes; counted, not measured,
        since a backend may still hold the buffer of a finished collective for a moment."""
        self.version = self.buffer._version
        self.uses = 2 + len(self.views) + (self.array is not None)

    def free(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
        """Whether the slot may be written and its views handed out again: the buffer as asked, unchanged since
        ``commit``, no tensor but its views sharing its memory, no Python reference to a view left (each
        view's count is 2: the slot's tuple and the count's own argument; the sum says it, since none is
        less), and every view as it was handed out (``check``: no ``requires_grad`` set on it since, nor its
        shape, strides or dtype changed in place)."""
        buffer, views = self.buffer, self.views
        if not (buffer.shape == shape and buffer.dtype == dtype and buffer.device == device
                and buffer._version == self.version and self._uses() == self.uses
                and sum(map(sys.getrefcount, views)) == 2 * len(views)):
            return False
        check = self.check
        return check(*views) if check is not None else not any(map(_requires_grad, views))


class Pool:
    """Up to POOL_DEPTH slots whose views are made by ``make_views`` (default: ``unbind``). A slot's view objects
    are handed out again, with new values, once no Python reference to any of them is left, no other tensor
    shares the buffer's memory (a view, ``.numpy()``, a tensor saved for backward), and no in-place change and
    no ``requires_grad`` (nor any other change of a view's metadata) happened since; otherwise a new buffer is used,
    so results a caller keeps never change."""

    def __init__(self, make_views: Views = Tensor.unbind) -> None:
        self.make_views = make_views
        self.slots: List[Slot] = []

    def _free(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Any:
        if _use_count is None:
            return None
        for slot in self.slots:
            if slot.free(shape, dtype, device):
                return slot
        return None

    def _keep(self, slot: Slot) -> Slot:
        """Keep a new ``slot`` (before its views are handed out) while the pool has room, with its check."""
        if _use_count is not None and len(self.slots) < POOL_DEPTH:
            slot.check = tensor_check(slot.views, sizes=False)
            self.slots.append(slot)
        return slot

    def views(self, result: Tensor) -> Sequence[Tensor]:
        """Views holding ``result``'s values: a free slot's, refilled, or ``result``'s own (kept as a slot)."""
        slot = self._free(tuple(result.shape), result.dtype, result.device)
        if slot is None:
            return self._keep(Slot(result, self.make_views)).views
        slot.buffer.copy_(result)
        slot.commit()
        return slot.views

    def acquire(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Slot:
        """A slot to write into (a free one, or a new empty buffer); ``commit`` it once written."""
        slot = self._free(shape, dtype, device)
        if slot is None:
            slot = self._keep(Slot(torch.empty(shape, dtype=dtype, device=device), self.make_views))
        return slot


def pool_of(owner: Any, kind: str, make_views: Views = Tensor.unbind) -> Pool:
    """The pool named ``kind`` kept on ``owner`` (a Bucket) in its ``cache`` dict."""
    pool = owner.cache.get(kind)
    if pool is None:
        pool = owner.cache[kind] = Pool(make_views)
    return pool


def stacked_slot(bucket: Any, size: int, device: torch.device) -> Slot:
    """The reused ``(leaves, size)`` result buffer of an all_gather's 0-d ``bucket`` (a Bucket) of POOL_MIN_LEAVES
    or more leaves: a free slot of its "stacked" pool, or a new one; ``commit`` it once written. Needs none of
    the gathered data: found while the header exchange runs (``header.agree``'s ``during``)."""
    return pool_of(bucket, "stacked").acquire((len(bucket.ids), size), bucket.wire, device)


# ---------------------------------------------------------------------------------------------- header rows
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
    numpy array on CPU, else None); a row of at most ``room`` bytes rides inline. ``gathered`` holds every
    rank's words after the exchange (width 1: an int64 SUM all_reduce with this rank's word at its index and
    zeros elsewhere; wider rows: an all_gather), ``rows`` every rank's payload. Nothing handed to a caller
    is a view of it."""

    def __init__(self, owner: "Header", width: int) -> None:
        size, index, device = owner.size, owner.index, owner.device
        self.owner, self.width, self.size = owner, width, size
        self.capacity = CAPACITY if width == 1 else 8 * (width - 1)
        self.room = CAPACITY if width == 1 else self.capacity // UNIT * UNIT
        self.gathered = torch.zeros((size, width), dtype=torch.int64, device=device)
        self.mine = self.gathered[index] if width == 1 else torch.zeros(width, dtype=torch.int64, device=device)
        self.payload = self.mine.view(torch.uint8)[:self.capacity]
        self.own_rows = self.rows = self.gathered.view(torch.uint8)[:, :self.capacity]
        self.result = self.gathered
        self.sized = False
        cpu = self.gathered.device.type == "cpu"
        self.numpy = self.gathered.numpy() if cpu else None
        mine_np = self.mine.numpy() if cpu else None
        self.halves = mine_np.view("uint32") if mine_np is not None else None
        #: every rank's last word as (low, tag) uint32 pairs, read straight from the exchanged buffer
        self.last_halves = self.numpy[:, -1:].view("uint32") if self.numpy is not None else None
        self.payload_np = mine_np.view("uint8")[:self.capacity] if mine_np is not None else None


class Header:
    """The header of one group on this rank: its buffers by width and the recent payload sizes that set the
    next call's width (``header.agree`` records them). Every rank of the group sees the same calls agree, so
    every rank computes the same width for the next call: the exchange always matches up."""

    def __init__(self, size: int, index: int, device: torch.device) -> None:
        self.size, self.index, self.device = size, index, device
        self.limit = max_width(size)
        self.needs: Deque[int] = deque([1], maxlen=HISTORY)
        self.width = 1
        self.buffers: Dict[int, Words] = {}


class Packed(NamedTuple):
    """A reduction's leaves on the wire: the header row ``words`` (None: no header exchange); ``inline``: the
    data is in its payload, nothing else to send; else per bucket ``(wire buffer, divided, slot, source)``:
    ``divided``, a mean was (or the wire divides it) before the sum; ``slot``, the reused buffer (pool slot) a
    large single tensor ``source`` is copied into by the wire while it is reduced; or, ``inplace``, ``source``
    is the caller's tensor, divided in place by the wire. ``low``: the header's low half (this row's size in
    units), or None when the payload fills it."""

    words: Optional[Words]
    inline: bool
    buffers: List[Tuple[Tensor, bool, Optional[Slot], Optional[Tensor]]]
    low: Optional[int]


class Row:
    """This rank's all_gather row: the header row ``words`` (None: no header exchange), its ``length``,
    ``low`` (its length in UNIT-byte units; None when it fills a width-1 header), and either ``inline`` (written
    into the header's payload) or ``parts`` ((byte offset, uint8 tensor)) the wire assembles; ``slot``: the
    reused output buffer one large tensor is gathered into."""

    def __init__(self, words: Optional[Words], length: int, low: Optional[int], inline: bool,
                 parts: List[Tuple[int, Tensor]], slot: Optional[Slot] = None) -> None:
        self.words, self.length, self.low, self.inline, self.parts, self.slot = words, length, low, inline, parts, slot


class Message(NamedTuple):
    """A broadcast's object as ``skeleton`` (its pickle, tensors left out) and the tensors' bytes ``parts``
    ((offset, uint8 tensor), ``nbytes`` in all); ``message``: the whole as parts (skeleton length, skeleton,
    tensor bytes), ``length`` bytes, ``low`` units; the header row ``words`` (None: no header exchange);
    ``inline``: the message is written into its payload."""

    words: Optional[Words]
    skeleton: bytes
    parts: List[Tuple[int, Tensor]]
    nbytes: int
    message: List[Tuple[int, Tensor]]
    length: int
    low: int
    inline: bool
