"""Property tests through the structure and plan caches: a collection changes between calls (keys added or
removed, a dtype, a shape, a leaf's type, a container type, or the same dict mutated in place), and each call
must still give the right values, container types and each rank's own key order on every rank.

Inside real ranks (a gloo group from tests/support/pool.py). Every rank draws the same examples (derandomize=True,
no database, no shrinking) and builds every rank's collections itself (they are a function of the rank, the
key and the step), so each rank checks its results against plain torch over every rank's inputs; the ranks
agree on pass / fail before asserting, so a failure fails every rank at the same example; the verdicts travel
through raw torch.distributed on a group of their own (tests/support/pool.py: ``agree``), never through the
collectives under test, and a failure names the example, the step and each failed rank. Odd ranks insert their
keys in reverse order.
"""
from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pool import agree, verdict_group

DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
          "bool": torch.bool, "float16": torch.float16}
SHAPES = [(), (1,), (3,), (2, 2)]
TOPS = {"dict": dict, "OrderedDict": OrderedDict, "defaultdict": lambda pairs: defaultdict(list, pairs)}
KEYS = "abcdefg"
EXAMPLES = 25

_leaf = st.one_of(
    st.tuples(st.just("T"), st.sampled_from(sorted(DTYPES)), st.sampled_from(SHAPES)),
    st.tuples(st.just("N"), st.sampled_from(["int", "float", "bool"])),
    st.tuples(st.just("S")),
)
_node = st.one_of(_leaf, st.tuples(st.sampled_from(["L", "U"]), st.tuples(_leaf, _leaf)))
_change = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(KEYS), _node),
    st.tuples(st.just("remove"), st.integers(0, 6)),
    st.tuples(st.just("dtype"), st.integers(0, 6), st.sampled_from(sorted(DTYPES))),
    st.tuples(st.just("shape"), st.integers(0, 6), st.sampled_from(SHAPES)),
    st.tuples(st.just("leaf type"), st.integers(0, 6), _leaf),
    st.tuples(st.just("container"), st.integers(0, 6), st.sampled_from(sorted(TOPS))),
)
_steps = st.lists(st.tuples(_change, st.booleans()), min_size=2, max_size=6)  # (change, mutate the dict in place)
#: any dict, or a uniform one (0-d tensors of one dtype: the one-stack path of structure.SpecCache.find)
_start = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), _node, min_size=1, max_size=4),
    st.sampled_from(sorted(DTYPES)).flatmap(
        lambda dtype: st.dictionaries(st.sampled_from(KEYS), st.just(("T", dtype, ())), min_size=2, max_size=7)),
)


# ---------------------------------------------------------------------------------------------- collections
def _value(bp: Any, rank: int, key: str, step: int) -> Any:
    seed = 3 * (KEYS.index(key) + 1) + 5 * step + rank
    kind = bp[0]
    if kind in ("L", "U"):
        items = [_value(x, rank, key, step + 7 * i) for i, x in enumerate(bp[1])]
        return items if kind == "L" else tuple(items)
    if kind == "S":
        return f"{key}{step}-rank{rank}"
    if kind == "N":
        return {"int": seed * 1000 + 2 ** 40, "float": 0.5 * seed, "bool": seed % 2 == 0}[bp[1]]
    _, dtype, shape = bp
    numel = 1
    for s in shape:
        numel *= s
    base = (torch.arange(numel) % 4 + seed).reshape(shape)
    return base % 2 == 0 if dtype == "bool" else base.to(DTYPES[dtype])


def _change_node(bp: Any, change: Tuple[Any, ...]) -> Any:
    """The node after a dtype / shape / leaf type / nested container change (a no-op where it does not apply)."""
    what = change[0]
    if what == "leaf type":
        return change[2]
    if bp[0] in ("L", "U"):
        if what == "container":
            return ("U" if bp[0] == "L" else "L", bp[1])
        return (bp[0], (_change_node(bp[1][0], change), bp[1][1]))
    if bp[0] == "T" and what == "dtype":
        return ("T", change[2], bp[2])
    if bp[0] == "T" and what == "shape":
        return ("T", bp[1], change[2])
    return bp


def _history(start: Dict[str, Any], steps: List[Tuple[Any, bool]], rank: int) -> Iterator[Any]:
    """Rank ``rank``'s collection at each step, yielded before the next step changes it: rebuilt in this
    rank's key order, or (``in place``) the previous dict itself, changed in place."""
    plan, top = dict(start), "dict"

    def build(step: int) -> Any:
        keys = sorted(plan, reverse=rank % 2 == 1)
        return TOPS[top]([(k, _value(plan[k], rank, k, step)) for k in keys])
    current = build(0)
    yield current
    for step, (change, in_place) in enumerate(steps, start=1):
        keys = sorted(plan)
        what = change[0]
        touched = None
        if what == "add":
            touched = change[1]
            plan[touched] = change[2]
        elif what == "remove":
            if len(plan) > 1:
                victim = keys[change[1] % len(keys)]
                del plan[victim]
                if in_place:
                    del current[victim]
        elif what == "container" and change[1] % 2 == 0:
            top = change[2]
            in_place = False
        else:
            touched = keys[change[1] % len(keys)]
            plan[touched] = _change_node(plan[touched], change)
        if in_place:
            if touched is not None:
                current[touched] = _value(plan[touched], rank, touched, step)
        else:
            current = build(step)
        yield current


# ---------------------------------------------------------------------------------------------- references
def _ref_leaf(values: List[Any], op: str, mine: Any) -> Any:
    first = values[0]
    if isinstance(first, torch.Tensor):
        stacked = torch.stack(values)
        if op == "gather":
            return stacked
        return stacked.sum(0, dtype=torch.int64 if first.dtype == torch.bool else first.dtype)
    if isinstance(first, str):
        return list(values) if op == "gather" else mine
    dtype = torch.bool if isinstance(first, bool) else torch.int64 if isinstance(first, int) else torch.float64
    if op == "gather":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(sum(values), dtype=torch.int64 if dtype == torch.bool else dtype)


def _compare(got: Any, mine: Any, everyone: List[Any], op: str, path: str = "") -> str:
    """'' when ``got`` is the right result for this rank's ``mine`` (types, key order, values); else why not."""
    if isinstance(mine, dict):
        if type(got) is not type(mine):
            return f"{path}: {type(got).__name__} instead of {type(mine).__name__}"
        if list(got) != list(mine):
            return f"{path}: keys {list(got)} instead of this rank's order {list(mine)}"
        if isinstance(mine, defaultdict) and got.default_factory is not mine.default_factory:
            return f"{path}: default_factory lost"
        for k in mine:
            why = _compare(got[k], mine[k], [o[k] for o in everyone], op, f"{path}[{k!r}]")
            if why:
                return why
        return ""
    if isinstance(mine, (list, tuple)):
        if type(got) is not type(mine) or len(got) != len(mine):
            return f"{path}: {type(got).__name__} of {len(got)} instead of {type(mine).__name__} of {len(mine)}"
        for i in range(len(mine)):
            why = _compare(got[i], mine[i], [o[i] for o in everyone], op, f"{path}[{i}]")
            if why:
                return why
        return ""
    want = _ref_leaf(everyone, op, mine)
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return f"{path}: {got!r} instead of {want!r}"
        close = torch.allclose(got.double(), want.double()) if want.is_floating_point() else torch.equal(got, want)
        return "" if close else f"{path}: {got!r} instead of {want!r}"
    return "" if got == want else f"{path}: {got!r} instead of {want!r}"


# ---------------------------------------------------------------------------------------------- in the ranks
_SETTINGS = dict(derandomize=True, database=None, deadline=None, max_examples=EXAMPLES,
                 phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


def _changing_structures(fabric) -> int:
    rank, world = fabric.global_rank, fabric.world_size
    seen = [0]
    group = verdict_group()

    @settings(**_SETTINGS)
    @given(start=_start, steps=_steps)
    def prop(start, steps):
        seen[0] += 1
        detail = ""
        for step, everyone in enumerate(zip(*[_history(start, steps, r) for r in range(world)])):
            mine = everyone[rank]
            for op in ("sum", "gather"):
                try:
                    got = fabric.all_reduce(mine, reduce_op="sum") if op == "sum" else fabric.all_gather(mine)
                    detail = _compare(got, mine, everyone, op)
                except Exception as err:  # noqa: BLE001 - reported through the agreement
                    detail = f"{type(err).__name__}: {err}"
                if detail:
                    detail = f"step {step} ({steps[step - 1] if step else 'start'}), {op}: {detail}"
                    break
            agree(group, (start, steps), detail)

    prop()
    return seen[0]


@pytest.mark.parametrize("ranks", [2, 3])
def test_structures_changing_between_calls(ranks, pool2, pool3):
    pool = pool2 if ranks == 2 else pool3
    assert pool.run(_changing_structures) == [EXAMPLES] * ranks


def test_the_histories_change_what_they_claim():
    """The generator itself: an in-place step keeps the dict object, a rebuilt one does not; odd ranks
    insert keys in reverse order."""
    start = {"a": ("T", "float32", ()), "b": ("N", "int")}
    steps = [(("dtype", 0, "int64"), True), (("add", "c", ("S",)), False), (("remove", 0), True),
             (("container", 0, "OrderedDict"), True), (("shape", 0, (3,)), False)]
    snapshots = []
    for d0, d1 in zip(_history(start, steps, 0), _history(start, steps, 1)):
        snapshots.append((id(d0), type(d0), list(d0), list(d1), {k: getattr(v, "dtype", None) for k, v in d0.items()}))
    ids = [s[0] for s in snapshots]
    assert ids[1] == ids[0] and snapshots[1][4]["a"] == torch.int64  # dtype changed in place
    assert ids[2] != ids[1] and snapshots[2][2] == ["a", "b", "c"] and snapshots[2][3] == ["c", "b", "a"]
    assert ids[3] == ids[2] and snapshots[3][2] == ["b", "c"]  # removed in place
    assert snapshots[4][1] is OrderedDict and snapshots[4][3] == ["c", "b"]
    assert len(snapshots) == len(steps) + 1
