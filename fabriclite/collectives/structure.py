"""Stage 1 of every collective: the caller's collection taken apart, and what its structure is.

``flatten`` gives the leaves in the caller's order and a hashable structure (``Tree``); ``SpecCache.get`` gives
the structure's ``Spec``, made once per structure and leaf signature: each leaf's kind and tensor metadata, the
canonical leaf order, and, per collective mode, the lines every rank compares and their digest. The way back
(``rebuild``) is the last stage, in unpacking.py.

Containers are mappings (dict, OrderedDict, defaultdict, any ``Mapping``), lists, tuples, namedtuples and
dataclass instances; everything else (tensors, numbers, strings, arbitrary objects) is a leaf. A structure is a
nested tuple that compares equal for two collections of the same shape, container types and keys, so it can key
a cache; the spec cache keys by it and by a signature of the leaves (type, dtype, shape, device of every leaf;
one entry when they are all alike), so anything that changes a digest or a bucket changes the key.

The common case, many 0-d tensors of one dtype on one device (a dict of metrics), costs one pass per property:
``SpecCache.find`` looks the structure up alone and ``read_uniform`` compares the leaves with the cached spec and
reads their values. On the CPU: the dtypes are compared in one pass, the devices and the dims checked in one
pass each, and the values read by ``item()`` into a list (a Python number per leaf, in the caller's order: what
numpy writes into the wire row with one assignment). On another device, where an ``item()`` per leaf would wait
for the device each time, one ``torch.stack`` reads the values and checks that every leaf is a tensor of the same
shape on the same device. Anything else falls back to the full key.
"""
from __future__ import annotations

import dataclasses
import hashlib
import operator
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from fabriclite.collectives.buffers import tensor_check

#: the structure of a single leaf
LEAF = 0
#: (kind, container type, keys or length or field names, children or None when every child is a leaf,
#:  extra: a defaultdict's default_factory)
Tree = Any
MAPPING, SEQUENCE, NAMEDTUPLE, DATACLASS = "M", "S", "N", "D"
_KINDS: Dict[type, str] = {}

TENSOR, NUMBER, OBJECT = "T", "N", "O"
#: Python number type -> the exact dtype it travels in
NUMBER_DTYPES: Dict[type, torch.dtype] = {bool: torch.bool, int: torch.int64, float: torch.float64,
                                          complex: torch.complex128}
_NUMBER_NAMES = {torch.bool: "bool", torch.int64: "int", torch.float64: "float", torch.complex128: "complex"}
_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")
_device = operator.attrgetter("device")
_dim = Tensor.dim
_is_cpu = operator.attrgetter("is_cpu")
_item = Tensor.item
_CPU = torch.device("cpu")
#: from this many 0-d tensors of one dtype and device, ``SpecCache.find`` checks and reads them in one go
STACK_MIN = 2
#: the values of a uniform collection (``read_uniform``): a list of Python numbers (CPU) or an ``(n,)`` tensor
Values = Union[List[Any], Tensor]


# ---------------------------------------------------------------------------------------------- flatten
def container_kind(cls: type) -> str:
    """"M", "S", "N" or "D" for a container type, "" for a leaf type (memoised per type)."""
    kind = _KINDS.get(cls)
    if kind is None:
        if issubclass(cls, Tensor) or issubclass(cls, (str, bytes)):
            kind = ""
        elif issubclass(cls, Mapping):
            kind = MAPPING
        elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
            kind = NAMEDTUPLE
        elif issubclass(cls, (list, tuple)):
            kind = SEQUENCE
        elif dataclasses.is_dataclass(cls):
            kind = DATACLASS
        else:
            kind = ""
        _KINDS[cls] = kind
    return kind


def _all_leaves(values: Sequence[Any]) -> bool:
    kinds = _KINDS
    for cls in set(map(type, values)):
        kind = kinds.get(cls)
        if kind is None:
            kind = container_kind(cls)
        if kind:
            return False
    return True


def flatten(data: Any) -> Tuple[Tree, List[Any]]:
    """``(structure, leaves)``: the leaves in the caller's order (mapping insertion order, sequence order,
    dataclass field order)."""
    leaves: List[Any] = []
    return _walk(data, leaves), leaves


def _walk(x: Any, leaves: List[Any]) -> Tree:
    cls = type(x)
    kind = container_kind(cls)
    if not kind:
        leaves.append(x)
        return LEAF
    extra = None
    if kind == MAPPING:
        keys: Any = tuple(x.keys())
        values = list(x.values()) if isinstance(x, dict) else [x[k] for k in keys]
        extra = getattr(x, "default_factory", None)
    elif kind == DATACLASS:
        keys = tuple(f.name for f in dataclasses.fields(x))
        values = [getattr(x, name) for name in keys]
    else:
        values = list(x)
        keys = len(values)
    if _all_leaves(values):
        leaves.extend(values)
        return (kind, cls, keys, None, extra)
    return (kind, cls, keys, tuple(_walk(v, leaves) for v in values), extra)


def leaf_paths(tree: Tree) -> List[Tuple[Tuple[Any, ...], str]]:
    """For each leaf in the caller's order: (sort key, path text). Sorting by the sort key gives the
    canonical order (mapping keys sorted, so two ranks with the same keys in a different insertion order
    meet by key); the path text (``['a'][0].x``) names the leaf in error messages and structure digests."""
    out: List[Tuple[Tuple[Any, ...], str]] = []
    _paths(tree, (), "", out)
    return out


def _paths(tree: Tree, key: Tuple[Any, ...], text: str, out: List[Tuple[Tuple[Any, ...], str]]) -> None:
    if tree is LEAF:
        out.append((key, text or "<root>"))
        return
    kind, cls, keys, children, _ = tree
    if kind == MAPPING:
        steps = [((0, type(k).__qualname__, repr(k)), f"[{k!r}]") for k in keys]
    elif kind == DATACLASS:
        steps = [((2, i, name), f".{name}") for i, name in enumerate(keys)]
    else:
        steps = [((1, i, ""), f"[{i}]") for i in range(keys)]
    for i, (sort, step) in enumerate(steps):
        child = LEAF if children is None else children[i]
        _paths(child, key + (sort,), text + step, out)


# ---------------------------------------------------------------------------------------------- spec
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


class Spec:
    """Everything about one structure that does not depend on the leaves' values. ``lines[mode]`` and
    ``digests[mode]`` hold what ``describe`` / ``digest`` gave for a mode; ``plans`` is the plan stage's cache."""

    def __init__(self, tree: Tree, leaves: Sequence[Any], alike: bool) -> None:
        self.tree = tree
        self.leaves = [_leaf(x) for x in leaves]
        self.alike = alike
        paths = leaf_paths(tree)
        self.paths = [text for _, text in paths]
        self.order = sorted(range(len(paths)), key=lambda i: paths[i][0])
        self.digests: Dict[str, Tuple[int, int]] = {}
        self.lines: Dict[str, List[str]] = {}
        self.plans: Dict[Any, Any] = {}
        #: every leaf a 0-d tensor of one dtype on one device (at least STACK_MIN of them): (dtype, device),
        #: and that dtype once per leaf (what ``find`` compares the leaves' dtypes with)
        self.uniform: Optional[Tuple[torch.dtype, torch.device]] = None
        self.dtypes: List[torch.dtype] = []
        #: of a uniform Spec: ``buffers.tensor_check`` of the leaves it was last looked up with (set by
        #: ``SpecCache``), which ``read_uniform`` runs instead of its Python passes; None: the passes
        self.check: Optional[Callable[..., bool]] = None
        first = self.leaves[0] if self.leaves else None
        if (len(self.leaves) >= STACK_MIN and first is not None and first.kind == TENSOR and first.shape == ()
                and all(leaf == first for leaf in self.leaves)):
            assert first.dtype is not None and first.device is not None
            self.uniform = (first.dtype, first.device)
            self.dtypes = [first.dtype] * len(self.leaves)

    def describe(self, mode: str) -> List[str]:
        """One line per leaf, canonical order: ``path: description`` where the description holds what must
        agree across ranks for ``mode`` ("reduce", "stack", "cat", "gather")."""
        lines = self.lines.get(mode)
        if lines is None:
            lines = self.lines[mode] = [f"{self.paths[i]}: {_describe(self.leaves[i], mode)}" for i in self.order]
        return lines

    def digest(self, mode: str) -> Tuple[int, int]:
        """128-bit digest of ``describe(mode)`` as two signed int64 words (stable across processes)."""
        words = self.digests.get(mode)
        if words is None:
            raw = hashlib.blake2b("\n".join(self.describe(mode)).encode(), digest_size=16).digest()
            words = (int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:], "little", signed=True))
            self.digests[mode] = words
        return words


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
    """A bounded LRU of Specs keyed by (structure, leaf signature), and the last uniform Spec of each structure
    (``find``)."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._specs: "OrderedDict[Any, Spec]" = OrderedDict()
        self._uniform: "OrderedDict[Any, Spec]" = OrderedDict()

    def take_apart(self, data: Any, mode: str) -> Tuple[Tree, List[Any], Spec, Optional[Values]]:
        """Stage 1 in one call: ``flatten(data)`` and ``find``. A plain dict whose structure (its keys, in
        order) last held uniform leaves is looked up by its keys alone, without walking it: ``read_uniform``
        then proves that every value is still a leaf (a container has no tensor dtype)."""
        if type(data) is dict:
            leaves = list(data.values())
            tree: Tree = (MAPPING, dict, tuple(data), None, None)  # what flatten gives for a dict of leaves
            spec = self._uniform.get(tree) if self._uniform else None
            if spec is not None:
                values = read_uniform(spec, leaves)
                if values is not None:
                    if mode not in spec.digests:
                        spec.digest(mode)
                    return tree, leaves, spec, values
            if _all_leaves(leaves):
                return tree, leaves, self._known(tree, leaves, mode), None
        tree, leaves = flatten(data)
        spec, stacked = self.find(tree, leaves, mode)
        return tree, leaves, spec, stacked

    def find(self, tree: Tree, leaves: Sequence[Any], mode: str) -> Tuple[Spec, Optional[Values]]:
        """``(spec, values)``: the Spec of ``tree`` holding ``leaves`` (as ``get``), and, when the last Spec of
        ``tree`` was uniform (STACK_MIN or more 0-d tensors of one dtype on one device) and ``leaves`` still are
        (``read_uniform``), the leaves' values in the caller's order; else None."""
        try:
            spec = self._uniform.get(tree)
        except TypeError:  # an unhashable structure (a dict key or default_factory): never cached
            spec = None
        if spec is not None:
            values = read_uniform(spec, leaves)
            if values is not None:
                if mode not in spec.digests:
                    spec.digest(mode)
                return spec, values
        return self._known(tree, leaves, mode), None

    def _known(self, tree: Tree, leaves: Sequence[Any], mode: str) -> Spec:
        """``get``, remembering a uniform Spec as its structure's last one."""
        spec = self.get(tree, leaves, mode)
        if spec.uniform is not None:
            spec.check = tensor_check(leaves)  # these leaves, as they are now (requires_grad included)
            try:
                self._uniform[tree] = spec
            except TypeError:
                pass
            else:
                if len(self._uniform) > self.capacity:
                    self._uniform.popitem(last=False)
        return spec

    def get(self, tree: Tree, leaves: Sequence[Any], mode: str) -> Spec:
        """The Spec of ``tree`` holding ``leaves``, with ``lines[mode]`` and ``digests[mode]`` made."""
        sig = signature(leaves)
        key = (tree, sig)
        try:
            spec = self._specs[key]
        except (KeyError, TypeError):
            spec = Spec(tree, leaves, alike=isinstance(sig, tuple) and bool(sig) and sig[0] == "alike")
            try:
                self._specs[key] = spec
            except TypeError:  # an unhashable key (a dict key or default_factory): not cached
                pass
            else:
                if len(self._specs) > self.capacity:
                    self._specs.popitem(last=False)
        if mode not in spec.digests:
            spec.digest(mode)
        return spec

    def clear(self) -> None:
        self._specs.clear()
        self._uniform.clear()


def read_uniform(spec: Spec, leaves: Sequence[Any]) -> Optional[Values]:
    """The leaves' values in the caller's order when they match the uniform ``spec`` (every leaf a 0-d tensor of
    its dtype on its device), else None. ``spec.check`` (one C++ pass: each leaf a tensor of the type, dtype,
    device, shape, strides, requires_grad and dispatch keys of the leaves the spec was last found with) proves
    it where torch has that check; else one Python pass compares the dtypes (a leaf without one, or with
    another, fails it), and on the CPU one pass checks the devices and one the dims. On the CPU ``item()`` then
    reads each value: a list of Python numbers. Elsewhere ``torch.stack`` reads the values (and checks the
    shapes and devices again: a non-tensor leaf raises, a shape or device that differs from the others raises,
    and the result's shape and device tell whether the common shape is 0-d and the device the spec's): an
    ``(n,)`` tensor."""
    uniform = spec.uniform
    if uniform is None or len(leaves) != len(spec.dtypes):
        return None
    cpu = uniform[1].type == "cpu"
    try:
        check = spec.check
        if check is not None:
            if not check(*leaves):
                return None
        elif list(map(_dtype, leaves)) != spec.dtypes:
            return None
        elif cpu and (not all(map(_is_cpu, leaves)) or any(map(_dim, leaves))):
            return None
        if cpu:
            return list(map(_item, leaves))
        stacked = torch.stack(leaves)  # type: ignore[arg-type]
    except (AttributeError, TypeError, RuntimeError, ValueError):
        return None
    if (stacked.dim() != 1 or stacked.dtype != uniform[0] or stacked.device != uniform[1]
            or stacked.layout != torch.strided):
        return None
    return stacked
