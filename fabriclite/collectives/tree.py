"""Nested collections in and out: leaves in the user's order, a hashable structure, the same structure back.

Containers are mappings (dict, OrderedDict, defaultdict, any ``Mapping``), lists, tuples, namedtuples and
dataclass instances; everything else (tensors, numbers, strings, arbitrary objects) is a leaf. A structure
(``Tree``) is a nested tuple that compares equal for two collections of the same shape, container types and
keys, so it can key a cache. ``rebuild`` gives back the caller's own container types and key order.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from torch import Tensor

#: the structure of a single leaf
LEAF = 0
#: (kind, container type, keys or length or field names, children or None when every child is a leaf,
#:  extra: a defaultdict's default_factory)
Tree = Any

MAPPING, SEQUENCE, NAMEDTUPLE, DATACLASS = "M", "S", "N", "D"
_KINDS: Dict[type, str] = {}


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
    return not any(container_kind(cls) for cls in set(map(type, values)))


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


def rebuild(tree: Tree, leaves: Sequence[Any], like: Any) -> Any:
    """The collection with structure ``tree`` holding ``leaves`` (in the order ``flatten`` gave them);
    ``like`` is the collection that was flattened (dataclasses are copied from it)."""
    if tree is LEAF:
        return leaves[0]
    kind, cls, keys, children, _ = tree
    if children is None:
        values: List[Any] = list(leaves)
    else:
        it = iter(leaves)
        values = [_build(child, it, item) for child, item in zip(children, _items(tree, like))]
    return _make(tree, values, like)


def _build(tree: Tree, it: Iterator[Any], like: Any) -> Any:
    if tree is LEAF:
        return next(it)
    kind, cls, keys, children, _ = tree
    if children is None:
        count = keys if isinstance(keys, int) else len(keys)
        values = [next(it) for _ in range(count)]
    else:
        values = [_build(child, it, item) for child, item in zip(children, _items(tree, like))]
    return _make(tree, values, like)


def _items(tree: Tree, like: Any) -> List[Any]:
    kind, cls, keys, _, _ = tree
    if kind == MAPPING:
        return [like[k] for k in keys]
    if kind == DATACLASS:
        return [getattr(like, name) for name in keys]
    return list(like)


def _make(tree: Tree, values: List[Any], like: Any) -> Any:
    kind, cls, keys, _, extra = tree
    if kind == MAPPING:
        return _make_mapping(cls, keys, values, like, extra)
    if kind == NAMEDTUPLE:
        return cls(*values)
    if kind == DATACLASS:
        out = copy.copy(like)
        for name, value in zip(keys, values):
            object.__setattr__(out, name, value)
        return out
    if cls is list or cls is tuple:
        return cls(values)
    try:
        return cls(values)
    except TypeError:
        return list(values) if isinstance(like, list) else tuple(values)


def _make_mapping(cls: type, keys: Tuple[Any, ...], values: List[Any], like: Any, factory: Optional[Any]) -> Any:
    pairs = zip(keys, values)
    if cls is dict:
        return dict(pairs)
    if factory is not None or hasattr(like, "default_factory"):
        return cls(factory, pairs)
    try:
        return cls(pairs)
    except TypeError:
        return dict(zip(keys, values))


# ---------------------------------------------------------------------------------------------- canonical order
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
