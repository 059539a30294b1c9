"""What a collection is, computed once per structure: each leaf's kind and tensor metadata, the canonical
leaf order, the structure digest that ranks compare, and the buckets leaves travel in.

``SpecCache.get(tree, leaves)`` keys specs by the structure (container types, keys) and a signature of the
leaves (type, dtype, shape, device of every leaf; one entry when they are all alike), so a repeated call
with the same structure skips every per-structure computation; anything that changes a digest or a bucket
changes the key.
"""
from __future__ import annotations

import hashlib
import operator
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from fabriclite.collectives import ops
from fabriclite.collectives.tree import Tree, leaf_paths

TENSOR, NUMBER, OBJECT = "T", "N", "O"
#: Python number type -> the exact dtype it travels in
NUMBER_DTYPES: Dict[type, torch.dtype] = {bool: torch.bool, int: torch.int64, float: torch.float64,
                                          complex: torch.complex128}
_NUMBER_NAMES = {torch.bool: "bool", torch.int64: "int", torch.float64: "float", torch.complex128: "complex"}
ALIGN = 16  # the largest element size (complex128): every typed view of a byte row stays legal
_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")
_device = operator.attrgetter("device")
_dim = Tensor.dim
_is_cpu = operator.attrgetter("is_cpu")
_CPU = torch.device("cpu")


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def number_dtype(cls: type) -> Optional[torch.dtype]:
    """The dtype a Python number of class ``cls`` travels in (bool before int: bool is an int)."""
    for base, dtype in NUMBER_DTYPES.items():
        if issubclass(cls, base):
            return dtype
    return None


def signature(leaves: Sequence[Any]) -> Hashable:
    """A hashable summary of the leaves' types and tensor metadata: equal signatures mean equal metadata."""
    if len(leaves) == 1:
        x = leaves[0]
        if isinstance(x, Tensor):
            return ("one", type(x), x.dtype, x.shape, x.device)
    types = set(map(type, leaves))
    if len(types) == 1 and leaves:
        cls = next(iter(types))
        if issubclass(cls, Tensor):
            dtypes = set(map(_dtype, leaves))
            if len(dtypes) == 1:
                dims = set(map(_dim, leaves))
                shapes = {()} if dims == {0} else set(map(_shape, leaves))
                devices = {_CPU} if all(map(_is_cpu, leaves)) else set(map(_device, leaves))
                if len(shapes) == 1 and len(devices) == 1:
                    return ("alike", cls, dtypes.pop(), tuple(shapes.pop()), devices.pop(), len(leaves))
        elif cls in NUMBER_DTYPES:
            return ("alike", cls, len(leaves))
    return tuple((type(x), x.dtype, tuple(x.shape), x.device) if isinstance(x, Tensor) else type(x) for x in leaves)


@dataclass
class Leaf:
    """One leaf's kind (TENSOR, NUMBER or OBJECT), dtype (a number's travel dtype), shape and device."""

    kind: str
    dtype: Optional[torch.dtype] = None
    shape: Tuple[int, ...] = ()
    device: Optional[torch.device] = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class Bucket:
    """Leaves that travel together as one typed flat buffer: ``ids`` (user-order leaf indices, canonical
    order), their numels and shapes, the ``wire`` dtype and the ``result`` dtype they come back in, and
    their byte ``offset`` in a row. ``mode``: "scalars" (0-d CPU tensors, read with item()), "numbers"
    (Python numbers), "single" (one tensor) or "general". ``whole``: the bucket holds every leaf, and (0-d
    modes) is packed in the caller's order and permuted to the canonical one on the wire by ``perm``."""

    wire: torch.dtype
    result: torch.dtype
    ids: List[int]
    numels: List[int]
    shapes: List[Tuple[int, ...]]
    mode: str
    offset: int = 0
    numel: int = 0
    devices: List[Optional[torch.device]] = field(default_factory=list)
    whole: bool = False
    perm: Optional[List[int]] = None
    take: Callable[[Sequence[Any]], Sequence[Any]] = field(default=lambda leaves: leaves, repr=False)
    cache: Dict[Any, Any] = field(default_factory=dict, repr=False)  # result pools, views of reused buffers
    _index: Dict[Any, Tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)
    _elsewhere: Dict[torch.device, bool] = field(default_factory=dict, repr=False)

    @property
    def nbytes(self) -> int:
        return self.numel * self.wire.itemsize

    @property
    def scalar(self) -> bool:
        """Every leaf is 0-d (a tensor or a Python number)."""
        return self.mode in ("scalars", "numbers")

    def elsewhere(self, device: torch.device) -> bool:
        """Whether a tensor leaf of this bucket lives on another device than ``device``."""
        known = self._elsewhere.get(device)
        if known is None:
            known = self._elsewhere[device] = any(d is not None and d != device for d in set(self.devices))
        return known

    def inverse_np(self) -> Any:
        """The inverse permutation as a numpy array: caller position -> canonical position."""
        return self.index(_CPU)[1].numpy()

    def index(self, device: torch.device) -> Tuple[Tensor, Tensor]:
        """``(perm, inverse)`` as index tensors on ``device``: caller order -> canonical, and back."""
        pair = self._index.get(device)
        if pair is None:
            assert self.perm is not None
            perm = torch.tensor(self.perm, dtype=torch.int64, device=device)
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(len(self.perm), device=device)
            pair = self._index[device] = (perm, inverse)
        return pair


@dataclass
class Layout:
    """How one rank's leaves sit in a byte row: ``nvar`` int64 words of varying dims first, then the fixed
    ``buckets`` (same place on every rank) up to ``fixed_end``, then the ``var_ids`` tensors, then the
    pickled ``object_ids`` leaves. ``var_dims``: per var tensor, "first" (only dim 0 varies) or "all"."""

    buckets: List[Bucket]
    fixed_end: int
    nvar: int = 0
    var_ids: List[int] = field(default_factory=list)
    var_dims: str = "first"
    object_ids: List[int] = field(default_factory=list)
    passthrough_ids: List[int] = field(default_factory=list)

    @property
    def used(self) -> int:
        """Bytes up to the end of the last bucket (a fixed-only layout's unaligned row length)."""
        return max((b.offset + b.nbytes for b in self.buckets), default=self.nvar * 8)

    @property
    def fixed_only(self) -> bool:
        return not self.var_ids and not self.object_ids


class Spec:
    """Everything about one structure that does not depend on the leaves' values."""

    def __init__(self, tree: Tree, leaves: Sequence[Any], alike: bool) -> None:
        self.tree = tree
        self.leaves = [_leaf(x) for x in leaves]
        self.alike = alike
        paths = leaf_paths(tree)
        self.paths = [text for _, text in paths]
        self.order = sorted(range(len(paths)), key=lambda i: paths[i][0])
        self._digests: Dict[str, Tuple[int, int]] = {}
        self._lines: Dict[str, List[str]] = {}
        self.plans: Dict[Any, Any] = {}

    # ------------------------------------------------------------------ agreement
    def describe(self, mode: str) -> List[str]:
        """One line per leaf, canonical order: ``path: description`` where the description holds what must
        agree across ranks for ``mode`` ("reduce", "stack", "cat", "gather")."""
        lines = self._lines.get(mode)
        if lines is None:
            lines = self._lines[mode] = [f"{self.paths[i]}: {_describe(self.leaves[i], mode)}" for i in self.order]
        return lines

    def digest(self, mode: str) -> Tuple[int, int]:
        """128-bit digest of ``describe(mode)`` as two signed int64 words (stable across processes)."""
        words = self._digests.get(mode)
        if words is None:
            raw = hashlib.blake2b("\n".join(self.describe(mode)).encode(), digest_size=16).digest()
            words = (int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True))
            self._digests[mode] = words
        return words

    # ------------------------------------------------------------------ plans
    def reduce_layout(self, op: str, python_mean_float: bool = True) -> Layout:
        """Buckets for a reduction with ``op``: tensors and numbers grouped by (wire, result) dtype; other
        leaves pass through. Raises TypeError when ``op`` does not apply to a leaf's dtype."""
        key = ("reduce", op)
        layout = self.plans.get(key)
        if layout is None:
            groups: Dict[Tuple[torch.dtype, torch.dtype], List[int]] = OrderedDict()
            passthrough = []
            for i in self.order:
                leaf = self.leaves[i]
                if leaf.kind == OBJECT:
                    passthrough.append(i)
                    continue
                assert leaf.dtype is not None
                try:
                    pair = ops.wire_and_result(leaf.dtype, op, python_number=leaf.kind == NUMBER)
                except TypeError as err:
                    raise TypeError(f"{self.paths[i]}: {err}") from None
                groups.setdefault(pair, []).append(i)
            buckets = [self._bucket(wire, result, ids) for (wire, result), ids in groups.items()]
            layout = self.plans[key] = Layout(buckets, _place(buckets, 0), passthrough_ids=passthrough)
        return layout

    def gather_layout(self, mode: str) -> Layout:
        """Row layout for ``mode``: "stack" (every tensor and number stacked; objects pickled), "cat" (tensors
        with dims concatenated along dim 0, which may differ) or "gather" (every tensor may differ in every
        dim; numbers and objects pickled)."""
        layout = self.plans.get(mode)
        if layout is None:
            groups: Dict[torch.dtype, List[int]] = OrderedDict()
            var_ids, object_ids = [], []
            for i in self.order:
                leaf = self.leaves[i]
                if leaf.kind == OBJECT or (leaf.kind == NUMBER and mode == "gather"):
                    object_ids.append(i)
                elif leaf.kind == TENSOR and (mode == "gather" or (mode == "cat" and leaf.shape)):
                    var_ids.append(i)
                else:
                    assert leaf.dtype is not None
                    groups.setdefault(leaf.dtype, []).append(i)
            nvar = len(var_ids) if mode == "cat" else sum(len(self.leaves[i].shape) for i in var_ids)
            buckets = [self._bucket(dtype, dtype, ids) for dtype, ids in groups.items()]
            end = _place(buckets, nvar * 8)
            layout = self.plans[mode] = Layout(buckets, end, nvar, var_ids, "first" if mode == "cat" else "all",
                                               object_ids)
        return layout

    def _bucket(self, wire: torch.dtype, result: torch.dtype, ids: List[int]) -> Bucket:
        leaves = [self.leaves[i] for i in ids]
        if all(leaf.kind == NUMBER for leaf in leaves):
            mode = "numbers"
        elif all(leaf.kind == TENSOR and not leaf.shape and leaf.device is not None and leaf.device.type == "cpu"
                 for leaf in leaves):
            mode = "scalars"
        elif len(ids) == 1:
            mode = "single"
        else:
            mode = "general"
        whole = sorted(ids) == list(range(len(self.leaves)))
        in_order = ids == list(range(len(self.leaves)))
        take = _taker(ids, len(self.leaves))
        bucket = Bucket(wire, result, ids, [leaf.numel for leaf in leaves], [leaf.shape for leaf in leaves], mode,
                        devices=[leaf.device for leaf in leaves], whole=whole, take=take)
        if whole and mode in ("scalars", "numbers"):
            bucket.take = _taker(list(range(len(ids))), len(ids))
            bucket.perm = None if in_order else list(ids)
        bucket.numel = sum(bucket.numels)
        return bucket


def _place(buckets: List[Bucket], start: int) -> int:
    offset = align(start)
    for bucket in buckets:
        bucket.offset = offset
        offset = align(offset + bucket.nbytes)
    return offset


def _taker(ids: List[int], total: int) -> Callable[[Sequence[Any]], Sequence[Any]]:
    if ids == list(range(total)):
        return lambda leaves: leaves
    if len(ids) == 1:
        only = ids[0]
        return lambda leaves: (leaves[only],)
    return operator.itemgetter(*ids)


def _leaf(x: Any) -> Leaf:
    if isinstance(x, Tensor):
        return Leaf(TENSOR, x.dtype, tuple(x.shape), x.device)
    dtype = number_dtype(type(x))
    if dtype is not None:
        return Leaf(NUMBER, dtype)
    return Leaf(OBJECT)


def _describe(leaf: Leaf, mode: str) -> str:
    if leaf.kind == OBJECT or (leaf.kind == NUMBER and mode == "gather"):
        return "object" if leaf.kind == OBJECT else "Python number"
    if leaf.kind == NUMBER:
        assert leaf.dtype is not None
        return f"Python {_NUMBER_NAMES[leaf.dtype]}"
    dtype = str(leaf.dtype).replace("torch.", "")
    if mode == "gather":
        return f"{dtype} tensor with {len(leaf.shape)} dims"
    if mode == "cat" and leaf.shape:
        rest = ", ".join(map(str, leaf.shape[1:]))
        return f"{dtype} tensor of shape (*{', ' + rest if rest else ''})"
    return f"{dtype} tensor of shape {tuple(leaf.shape)}"


class SpecCache:
    """A bounded LRU of Specs keyed by (structure, leaf signature)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._specs: "OrderedDict[Any, Spec]" = OrderedDict()

    def get(self, tree: Tree, leaves: Sequence[Any]) -> Spec:
        sig = signature(leaves)
        key = (tree, sig)
        try:
            spec = self._specs[key]
        except (KeyError, TypeError):
            spec = Spec(tree, leaves, alike=isinstance(sig, tuple) and bool(sig) and sig[0] == "alike")
            try:
                self._specs[key] = spec
            except TypeError:  # an unhashable key (a dict key or default_factory): not cached
                return spec
            if len(self._specs) > self.capacity:
                self._specs.popitem(last=False)
        return spec

    def clear(self) -> None:
        self._specs.clear()
