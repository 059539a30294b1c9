"""Property tests inside real ranks: random nested collections (dicts, lists, tuples, namedtuples) of tensors
of several dtypes and shapes, Python numbers and strings; every rank derives its values from its rank, and
each collective's result must equal a reference computed from every rank's inputs.

The ranks draw the same examples (derandomize=True, no database, no shrinking) and agree on pass/fail with
a collective before asserting, so a failure on one rank fails every rank at the same example instead of
leaving the others waiting.
"""
from __future__ import annotations

from collections import namedtuple
from typing import Any, List

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

Pair = namedtuple("Pair", "left right")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
          "bool": torch.bool}
SHAPES = [(), (1,), (3,), (2, 2)]
EXAMPLES = 30

_leaf = st.one_of(
    st.tuples(st.just("T"), st.sampled_from(sorted(DTYPES)), st.sampled_from(SHAPES)),
    st.tuples(st.just("N"), st.sampled_from(["int", "float", "bool"])),
    st.tuples(st.just("S")),
)
blueprints = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.dictionaries(st.sampled_from("abcde"), children, min_size=1, max_size=3).map(lambda d: ("D", d)),
        st.lists(children, min_size=1, max_size=3).map(lambda xs: ("L", xs)),
        st.tuples(children, children).map(lambda xs: ("U", list(xs))),
        st.tuples(children, children).map(lambda xs: ("P", list(xs))),
    ),
    max_leaves=8,
)


# ---------------------------------------------------------------------------------------------- data per rank
def materialize(bp: Any, rank: int, uneven: bool = False, counter: List[int] = None) -> Any:
    """Rank ``rank``'s collection for blueprint ``bp`` (dict keys reversed on odd ranks; with ``uneven``,
    dim 0 of tensors grows with the rank)."""
    counter = [0] if counter is None else counter
    kind = bp[0]
    if kind in ("D", "L", "U", "P"):
        items = bp[1]
        if kind == "D":
            keys = sorted(items, reverse=rank % 2 == 1)
            return {k: materialize(items[k], rank, uneven, counter) for k in keys}
        values = [materialize(x, rank, uneven, counter) for x in items]
        return {"L": list, "U": tuple, "P": lambda v: Pair(*v)}[kind](values)
    counter[0] += 1
    i = counter[0]
    if kind == "S":
        return f"leaf{i}-rank{rank}"
    if kind == "N":
        return {"int": (i + 1) * (rank + 2) + 2 ** 55, "float": 0.25 * i - rank, "bool": (i + rank) % 2 == 0}[bp[1]]
    dtype, shape = DTYPES[bp[1]], bp[2]
    if uneven and shape:
        shape = (shape[0] + rank, *shape[1:])
    numel = 1
    for s in shape:
        numel *= s
    base = torch.arange(numel, dtype=torch.int64).reshape(shape) * (rank + 1) + i - 3 * rank
    if dtype == torch.bool:
        return (base % 2) == 0
    if dtype.is_floating_point:
        return (base.to(dtype) * 0.5).to(dtype)
    return base.to(dtype)


def flatten(x: Any) -> List[Any]:
    """Leaves in canonical order (dict keys sorted), for comparing ranks' collections."""
    if isinstance(x, dict):
        return [leaf for k in sorted(x) for leaf in flatten(x[k])]
    if isinstance(x, (list, tuple)):
        return [leaf for v in x for leaf in flatten(v)]
    return [x]


def leaves_like(out: Any, like: Any) -> List[Any]:
    """``out``'s leaves in canonical order, read along ``like``'s structure; raises AssertionError when
    ``out`` does not have ``like``'s container types, key order and lengths."""
    if isinstance(like, dict):
        assert type(out) is type(like) and list(out) == list(like), f"{out!r} is not shaped like {like!r}"
        return [leaf for k in sorted(like) for leaf in leaves_like(out[k], like[k])]
    if isinstance(like, (list, tuple)):
        assert type(out) is type(like) and len(out) == len(like), f"{out!r} is not shaped like {like!r}"
        return [leaf for o, x in zip(out, like) for leaf in leaves_like(o, x)]
    return [out]


# ---------------------------------------------------------------------------------------------- references
def _exact(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.tensor(x, dtype={bool: torch.bool, int: torch.int64, float: torch.float64}[type(x)])


def ref_reduce(values: List[Any], op: str, world: int) -> Any:
    if isinstance(values[0], str):
        return None  # passes through: compared against the rank's own value
    number = not isinstance(values[0], torch.Tensor)
    stacked = torch.stack([_exact(v) for v in values])
    dtype = stacked.dtype
    mean_float = torch.float64 if number else torch.get_default_dtype()
    if dtype == torch.bool:
        if op == "sum":
            return stacked.to(torch.int64).sum(0)
        if op == "mean":
            return stacked.to(torch.int64).sum(0).to(mean_float) / world
        return stacked.amin(0) if op == "min" else stacked.amax(0)
    if op == "sum":
        return stacked.sum(0, dtype=dtype)
    if op == "mean":
        if dtype.is_floating_point:
            return stacked.sum(0, dtype=dtype) / world
        return (stacked.to(torch.int64).sum(0).to(torch.float64) / world).to(mean_float)
    return stacked.amin(0) if op == "min" else stacked.amax(0)


def ref_gather(values: List[Any], cat: bool) -> Any:
    if isinstance(values[0], str):
        return list(values)
    tensors = [_exact(v) for v in values]
    if cat and tensors[0].dim() > 0:
        return torch.cat(tensors)
    return torch.stack(tensors)


def equal(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return False
        if want.dtype.is_floating_point:
            return torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        return torch.equal(got, want)
    return got == want


# ---------------------------------------------------------------------------------------------- in the ranks
_SETTINGS = dict(derandomize=True, database=None, deadline=None, max_examples=EXAMPLES,
                 phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


def _agree(fabric, ok: bool, detail: str) -> None:
    """Every rank learns whether any rank failed, then all assert together."""
    failed = fabric.all_reduce(torch.tensor(0 if ok else 1), reduce_op="max").item()
    assert not failed, f"rank {fabric.global_rank}: {detail or 'another rank failed'}"


def _check(fabric, run, expect) -> None:
    try:
        ok, detail = expect(run())
    except Exception as err:  # noqa: BLE001 - reported through the agreement
        ok, detail = False, f"{type(err).__name__}: {err}"
    _agree(fabric, ok, detail)


def _all_reduce_property(fabric) -> int:
    rank, world = fabric.global_rank, fabric.world_size
    seen = [0]

    @settings(**_SETTINGS)
    @given(bp=blueprints, op=st.sampled_from(["sum", "mean", "min", "max"]))
    def prop(bp, op):
        seen[0] += 1
        mine = materialize(bp, rank)
        everyone = [flatten(materialize(bp, r)) for r in range(world)]
        own = flatten(mine)

        def expect(out):
            for k, got in enumerate(leaves_like(out, mine)):
                want = ref_reduce([leaves[k] for leaves in everyone], op, world)
                if want is None:
                    want = own[k]
                if not equal(got, want):
                    return False, f"leaf {k} ({op}): {got!r} != {want!r}"
            return True, ""
        _check(fabric, lambda: fabric.all_reduce(mine, reduce_op=op), expect)

    prop()
    return seen[0]


def _all_gather_property(fabric) -> int:
    rank, world = fabric.global_rank, fabric.world_size
    seen = [0]

    @settings(**_SETTINGS)
    @given(bp=blueprints, cat=st.booleans())
    def prop(bp, cat):
        seen[0] += 1
        mine = materialize(bp, rank, uneven=cat)
        everyone = [flatten(materialize(bp, r, uneven=cat)) for r in range(world)]

        def expect(out):
            for k, got in enumerate(leaves_like(out, mine)):
                want = ref_gather([leaves[k] for leaves in everyone], cat)
                if not equal(got, want):
                    return False, f"leaf {k} (cat={cat}): {got!r} != {want!r}"
            return True, ""
        _check(fabric, lambda: fabric.all_gather(mine, cat=cat), expect)

    prop()
    return seen[0]


def _broadcast_property(fabric) -> int:
    rank, world = fabric.global_rank, fabric.world_size
    seen = [0]

    @settings(**_SETTINGS)
    @given(bp=blueprints, src=st.integers(0, 7))
    def prop(bp, src):
        seen[0] += 1
        src = src % world
        mine = materialize(bp, rank)
        theirs = materialize(bp, src)

        def expect(out):
            got, want = leaves_like(out, theirs), flatten(theirs)
            for k, (g, w) in enumerate(zip(got, want)):
                if type(g) is not type(w) or not equal(g, w):
                    return False, f"leaf {k}: {g!r} != {w!r}"
            return True, ""
        _check(fabric, lambda: fabric.broadcast(mine, src=src), expect)

    prop()
    return seen[0]


@pytest.mark.parametrize("prop", [_all_reduce_property, _all_gather_property, _broadcast_property])
def test_properties_on_two_ranks(pool2, prop):
    assert pool2.run(prop) == [EXAMPLES, EXAMPLES]


@pytest.mark.parametrize("prop", [_all_reduce_property, _all_gather_property])
def test_properties_on_three_ranks(pool3, prop):
    assert pool3.run(prop) == [EXAMPLES] * 3
