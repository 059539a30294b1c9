"""Property tests inside real ranks: random nested collections (dicts, lists, tuples, namedtuples) of tensors
of every dtype the collectives carry (int8 to int64, uint8 to uint32, float16, bfloat16, float32, float64,
complex64, complex128, bool) and of several shapes (0-d, empty, and large enough to leave the header's inline
payload), Python numbers and strings, up to 50 leaves; every reduce op (the bitwise ones on integer and bool
leaves, min/max/prod on real ones). Every rank derives its values from its rank, and each collective's result
must equal a reference computed from every rank's inputs in plain torch (in int64, float64 or complex128, then
cast back: the wrap-around of the small integer types included).

Two modes (``HYPOTHESIS_PROFILE``):

- ``ci`` (the default): ``derandomize=True``, the same EXAMPLES cases on every run, for a stable CI;
- ``explore``: a fresh seed per run (printed; ``HYPOTHESIS_SEED=<seed>`` replays it) and more cases
  (``HYPOTHESIS_MAX_EXAMPLES``, default 200): ``HYPOTHESIS_PROFILE=explore pytest tests/integration/collectives/test_collectives_property.py``.

Both use no example database and no shrinking: the ranks draw the same examples (the same seed) and agree on
pass/fail before asserting, so a failure on one rank fails every rank at the same example instead of leaving the
others waiting. The verdicts travel through raw torch.distributed on a gloo group of their own
(tests/support/pool.py: ``verdict_group``, ``agree``), never through the collectives under test: a broken all_reduce cannot report success. A
failure names the example and every rank that failed, with its reason.
"""
from __future__ import annotations

import functools
import os
import random
from collections import namedtuple
from typing import Any, List, Optional

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from pool import agree, verdict_group

Pair = namedtuple("Pair", "left right")
INTS = ["int8", "uint8", "int16", "uint16", "uint32", "int32", "int64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
COMPLEX = ["complex64", "complex128"]
DTYPES = {name: getattr(torch, name) for name in [*INTS, *FLOATS, *COMPLEX, "bool"]}
#: (9000,) is larger than a header's inline payload (8184 bytes) even as int8 or bool
SHAPES = [(), (1,), (3,), (2, 2), (0,), (2, 0), (9000,)]
OPS = ["sum", "mean", "min", "max", "prod", "band", "bor", "bxor"]

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in ("ci", "explore"):
    raise ValueError(f"HYPOTHESIS_PROFILE={PROFILE!r}: expected 'ci' or 'explore'")
EXAMPLES = int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", 30 if PROFILE == "ci" else 200))


def dtypes_for(op: Optional[str]) -> List[str]:
    """The tensor dtypes ``op`` applies to (None: a collective without an op carries them all)."""
    if op in ("band", "bor", "bxor"):
        return [*INTS, "bool"]
    if op in ("min", "max", "prod"):
        return [*INTS, *FLOATS, "bool"]
    return sorted(DTYPES)


def blueprints(op: Optional[str] = None) -> st.SearchStrategy:
    """Nested collections of leaf descriptions for ``op``: up to 50 leaves, as a tree or one flat list."""
    numbers = ["int", "bool"] if op in ("band", "bor", "bxor") else ["int", "float", "bool"]
    leaf = st.one_of(
        st.tuples(st.just("T"), st.sampled_from(dtypes_for(op)), st.sampled_from(SHAPES)),
        st.tuples(st.just("N"), st.sampled_from(numbers)),
        st.tuples(st.just("S")),
    )
    tree = st.recursive(
        leaf,
        lambda children: st.one_of(
            st.dictionaries(st.sampled_from("abcdefgh"), children, min_size=1, max_size=5).map(lambda d: ("D", d)),
            st.lists(children, min_size=1, max_size=8).map(lambda xs: ("L", xs)),
            st.tuples(children, children).map(lambda xs: ("U", list(xs))),
            st.tuples(children, children).map(lambda xs: ("P", list(xs))),
        ),
        max_leaves=50,
    )
    # uniform collections (0-d tensors of one dtype: the one-stack path of structure.SpecCache.find), as a list or
    # a dict, from 2 leaves to more than the header's inline payload holds
    uniform = st.tuples(st.sampled_from(["L", "D"]), st.sampled_from(dtypes_for(op)),
                        st.sampled_from([2, 9, 300, 2500])).map(_uniform)
    return st.one_of(tree, st.lists(leaf, min_size=20, max_size=50).map(lambda xs: ("L", xs)), uniform)


def _uniform(spec: Any) -> Any:
    kind, dtype, n = spec
    leaves = [("T", dtype, ())] * n
    return ("L", leaves) if kind == "L" else ("D", {f"u{i}": leaf for i, leaf in enumerate(leaves)})


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
    if dtype.is_complex:
        return (base.to(torch.complex128) * (0.5 + 0.25j)).to(dtype)
    if dtype.is_floating_point:
        return (base.to(torch.float64) * 0.5).to(dtype)
    return base.to(dtype)  # wraps around for the small types: negative uint8, int8 beyond 127, ...


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
    """The reduction of every rank's ``values`` (one leaf each), in plain torch: integers in int64 then wrapped back
    into their dtype, floats in float64 (complex128) then rounded to theirs, bools as counts or truth values."""
    if isinstance(values[0], str):
        return None  # passes through: compared against the rank's own value
    number = not isinstance(values[0], torch.Tensor)
    stacked = torch.stack([_exact(v) for v in values])
    dtype = stacked.dtype
    mean_float = torch.float64 if number else torch.get_default_dtype()
    if op == "mean":
        if dtype.is_floating_point or dtype.is_complex:
            wide = torch.complex128 if dtype.is_complex else torch.float64
            return (stacked.to(wide).sum(0) / world).to(dtype)
        return (stacked.to(torch.int64).sum(0).to(torch.float64) / world).to(mean_float)
    if dtype == torch.bool:
        if op == "sum":
            return stacked.to(torch.int64).sum(0)
        if op == "bxor":
            return stacked.to(torch.int64).sum(0) % 2 == 1
        return stacked.all(0) if op in ("min", "prod", "band") else stacked.any(0)  # max, bor
    if dtype.is_floating_point or dtype.is_complex:
        wide = stacked.to(torch.complex128 if dtype.is_complex else torch.float64)
        folds = {"sum": lambda t: t.sum(0), "prod": lambda t: t.prod(0), "min": lambda t: t.amin(0),
                 "max": lambda t: t.amax(0)}
        return folds[op](wide).to(dtype)
    wide = stacked.to(torch.int64)
    folds = {"sum": lambda t: t.sum(0), "prod": lambda t: t.prod(0), "min": lambda t: t.amin(0),
             "max": lambda t: t.amax(0), "band": lambda t: functools.reduce(torch.bitwise_and, t.unbind(0)),
             "bor": lambda t: functools.reduce(torch.bitwise_or, t.unbind(0)),
             "bxor": lambda t: functools.reduce(torch.bitwise_xor, t.unbind(0))}
    return folds[op](wide).to(dtype)


def ref_gather(values: List[Any], cat: bool) -> Any:
    if isinstance(values[0], str):
        return list(values)
    tensors = [_exact(v) for v in values]
    if cat and tensors[0].dim() > 0:
        return torch.cat(tensors)
    return torch.stack(tensors)


def equal(got: Any, want: Any) -> bool:
    """Same type, dtype and shape; integers and bools exactly, floats within their dtype's rounding (a reduction
    over the ranks may round at each step where the reference rounds once)."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return False
        if want.dtype.is_floating_point or want.dtype.is_complex:
            wide = torch.complex128 if want.dtype.is_complex else torch.float64
            tol = 1e-2 if want.dtype in (torch.float16, torch.bfloat16) else 1e-5
            return torch.allclose(got.to(wide), want.to(wide), rtol=tol, atol=tol)
        return torch.equal(got, want)
    return got == want


# ---------------------------------------------------------------------------------------------- in the ranks
#: the strategies, built once: a blueprint for each op (only the dtypes it applies to), and one for any collective
_BY_OP = st.sampled_from(OPS).flatmap(lambda op: st.tuples(st.just(op), blueprints(op)))
_ANY = blueprints(None)


def _explore(test: Any, run_seed: Optional[int], examples: int) -> None:
    """Run the ``@given`` ``test`` for ``examples`` cases: derandomized (``run_seed`` None) or from ``run_seed``;
    every rank gets the same arguments, so draws the same cases."""
    test = settings(derandomize=run_seed is None, database=None, deadline=None, max_examples=examples,
                    phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))(test)
    if run_seed is not None:
        test = seed(run_seed)(test)
    test()


def _check(group, example, run, expect) -> None:
    try:
        ok, detail = expect(run())
    except Exception as err:  # noqa: BLE001 - reported through the agreement
        ok, detail = False, f"{type(err).__name__}: {err}"
    agree(group, example, "" if ok else (detail or "failed"))


def _all_reduce_property(fabric, run_seed: Optional[int], examples: int) -> int:
    rank, world = fabric.global_rank, fabric.world_size
    seen = [0]
    group = verdict_group()

    @given(case=_BY_OP)
    def prop(case):
        op, bp = case
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
        _check(group, (op, bp), lambda: fabric.all_reduce(mine, reduce_op=op), expect)

    _explore(prop, run_seed, examples)
    return seen[0]


def _all_gather_property(fabric, run_seed: Optional[int], examples: int) -> int:
    rank, world = fabric.global_rank, fabric.world_size
    seen = [0]
    group = verdict_group()

    @given(bp=_ANY, cat=st.booleans())
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
        _check(group, (bp, f"cat={cat}"), lambda: fabric.all_gather(mine, cat=cat), expect)

    _explore(prop, run_seed, examples)
    return seen[0]


def _broadcast_property(fabric, run_seed: Optional[int], examples: int) -> int:
    rank, world = fabric.global_rank, fabric.world_size
    seen = [0]
    group = verdict_group()

    @given(bp=_ANY, src=st.integers(0, 7))
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
        _check(group, (bp, f"src={src}"), lambda: fabric.broadcast(mine, src=src), expect)

    _explore(prop, run_seed, examples)
    return seen[0]


@pytest.fixture(scope="module")
def run_seed() -> Optional[int]:
    """None in the ci profile; else HYPOTHESIS_SEED, or a fresh seed."""
    if PROFILE == "ci":
        return None
    chosen = os.environ.get("HYPOTHESIS_SEED")
    return int(chosen) if chosen else random.SystemRandom().getrandbits(64)


def _run(pool, prop, run_seed: Optional[int]) -> List[int]:
    previous = pool.timeout
    pool.timeout = max(previous, 3.0 * EXAMPLES)  # the ranks run every example in one call
    try:
        return pool.run(prop, run_seed, EXAMPLES)
    except AssertionError as err:
        replay = "" if run_seed is None else f" (HYPOTHESIS_PROFILE=explore HYPOTHESIS_SEED={run_seed} replays it)"
        raise AssertionError(f"{prop.__name__} failed{replay}:\n{err}") from None
    finally:
        pool.timeout = previous
        if run_seed is not None:
            print(f"{prop.__name__}: {EXAMPLES} examples from seed {run_seed}")


@pytest.mark.parametrize("prop", [_all_reduce_property, _all_gather_property, _broadcast_property])
def test_properties_on_two_ranks(pool2, prop, run_seed):
    assert _run(pool2, prop, run_seed) == [EXAMPLES, EXAMPLES]


@pytest.mark.parametrize("prop", [_all_reduce_property, _all_gather_property])
def test_properties_on_three_ranks(pool3, prop, run_seed):
    assert _run(pool3, prop, run_seed) == [EXAMPLES] * 3
