"""Collectives in one process (Lightning's single-device contract) and their building blocks."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections import OrderedDict, defaultdict, namedtuple

import pytest
import torch

from fabriclite import Fabric, collectives
from fabriclite.collectives import ops
from fabriclite.collectives.buffers import Pool
from fabriclite.collectives.header import TAG_ERROR, UNIT
from fabriclite.collectives.packing import units
from fabriclite.collectives.plans import MAX_SIZE, Call, call_tag, wire_and_result
from fabriclite.collectives.state import state_of
from fabriclite.collectives.structure import Spec, flatten, signature
from fabriclite.collectives.unpacking import rebuild

Point = namedtuple("Point", "x y")


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    b: int
    note: str = "kept"


@pytest.fixture(scope="module")
def fabric():
    f = Fabric(accelerator="cpu", devices=1)
    f.launch()
    return f


def test_all_gather_keeps_lightnings_single_device_contract(fabric):
    t = torch.arange(6.0).reshape(2, 3)
    out = fabric.all_gather({"t": t, "n": 3, "f": 0.5, "s": "x", "z": torch.tensor(2)})
    assert out["t"].shape == (2, 3) and torch.equal(out["t"], t)
    assert out["n"].dtype == torch.int64 and out["n"].shape == () and out["n"].item() == 3
    assert out["f"].dtype == torch.float64 and out["z"].shape == ()
    assert out["s"] == ["x"]
    assert fabric.all_gather(t, cat=True).shape == (2, 3)


def test_all_gather_sync_grads_in_one_process(fabric):
    x = torch.ones(3, requires_grad=True)
    (fabric.all_gather(x, sync_grads=True) * 2).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


def test_all_reduce_dtypes_in_one_process(fabric):
    out = fabric.all_reduce({"i": torch.tensor([1, 2]), "n": 7, "b": True, "f": 2.5, "o": object})
    assert out["i"].dtype == torch.get_default_dtype() and out["i"].tolist() == [1.0, 2.0]
    assert out["n"].dtype == torch.float64 and out["b"].dtype == torch.float64 and out["o"] is object
    summed = fabric.all_reduce({"i": torch.tensor([1, 2], dtype=torch.int16), "b": torch.tensor(True)}, reduce_op="sum")
    assert summed["i"].dtype == torch.int16 and summed["b"].dtype == torch.int64 and summed["b"].item() == 1
    big = 2 ** 62 + 1
    assert fabric.all_reduce(big, reduce_op="max").item() == big


def test_errors_in_one_process_are_plain(fabric):
    with pytest.raises(ValueError, match="reduce_op='median' is not supported; expected sum, mean"):
        fabric.all_reduce(torch.ones(1), reduce_op="median")
    with pytest.raises(TypeError, match=r"\['x'\]: reduce_op='bor' needs integer or bool leaves"):
        fabric.all_reduce({"x": torch.ones(1)}, reduce_op="bor")
    with pytest.raises(TypeError, match="complex"):
        fabric.all_reduce(torch.ones(1, dtype=torch.complex64), reduce_op="max")
    with pytest.raises(ValueError, match=r"src=1 is out of range: expected a global rank in 0..0"):
        fabric.broadcast("x", src=1)
    with pytest.raises(ValueError, match="dst=2 is out of range"):
        fabric.gather(1, dst=2)
    with pytest.raises(ValueError, match="group"):
        fabric.all_reduce(torch.ones(1), group=[0])


def test_broadcast_gather_reduce_barrier_in_one_process(fabric):
    obj = {"t": torch.ones(2)}
    assert fabric.broadcast(obj) is obj
    gathered = fabric.gather({"t": torch.ones(2), "n": 3})
    assert len(gathered) == 1 and gathered[0]["n"] == 3 and gathered[0]["t"].tolist() == [1.0, 1.0]
    assert fabric.reduce(torch.tensor(4.0)).item() == 4.0
    fabric.barrier()
    with fabric.rank_zero_first():
        pass


def test_input_is_never_modified(fabric):
    data = {"x": torch.ones(3), "y": [torch.tensor(2.0)]}
    fabric.all_reduce(data, reduce_op="sum")
    fabric.all_gather(data)
    assert data["x"].tolist() == [1.0, 1.0, 1.0] and data["y"][0].item() == 2.0


# ---------------------------------------------------------------------------------------------- tree
def test_rebuild_gives_back_every_container_type():
    factory = defaultdict(list, {"k": torch.ones(1)})
    data = [OrderedDict(b=1, a=(2, Point(3, [4]))), factory, Frozen(torch.zeros(1), 5), ("s",), {}]
    structure, leaves = flatten(data)
    assert len(leaves) == 9  # the dataclass's str field is a leaf too
    out = rebuild(structure, [f"<{i}>" if not isinstance(x, str) else x for i, x in enumerate(leaves)], data)
    assert type(out) is list and type(out[0]) is OrderedDict and list(out[0]) == ["b", "a"]
    assert type(out[0]["a"][1]) is Point and out[0]["a"][1].y == ["<3>"]
    assert type(out[1]) is defaultdict and out[1].default_factory is list
    assert type(out[2]) is Frozen and out[2].a == "<5>" and out[2].b == "<6>" and out[2].note == "kept"
    assert out[3] == ("s",) and out[4] == {}


def test_same_keys_in_any_insertion_order_share_a_digest():
    one = {"b": torch.ones(2), "a": {"y": 1, "x": 2.0}}
    two = {"a": {"x": 2.0, "y": 1}, "b": torch.ones(2)}
    specs = [Spec(*_flat(d), alike=False) for d in (one, two)]
    assert specs[0].digest("reduce") == specs[1].digest("reduce")
    assert specs[0].describe("reduce") == ["['a']['x']: Python float", "['a']['y']: Python int",
                                           "['b']: float32 tensor of shape (2,)"]
    other = Spec(*_flat({"b": torch.ones(3), "a": {"y": 1, "x": 2.0}}), alike=False)
    assert other.digest("reduce") != specs[0].digest("reduce")
    assert other.digest("cat") == specs[0].digest("cat")  # dim 0 may differ under cat


def _flat(data):
    structure, leaves = flatten(data)
    return structure, leaves


def test_signature_tells_alike_leaves_from_different_ones():
    alike = [torch.zeros(()) for _ in range(5)]
    assert signature(alike)[0] == "alike"
    assert signature(alike) != signature(alike[:4] + [torch.zeros((), dtype=torch.float64)])
    assert signature(alike) != signature(alike[:4] + [torch.zeros(1)])
    assert signature([1, 2]) != signature([1, True])


def test_specs_are_cached_per_structure(fabric):
    state = state_of(fabric.strategy)
    state.specs.clear()
    for step in range(5):
        fabric.all_reduce({"loss": torch.tensor(float(step)), "acc": torch.tensor(0.5)})
    assert len(state.specs._specs) == 1
    fabric.all_reduce({"loss": torch.tensor(1.0), "acc": torch.tensor(1, dtype=torch.int64)})
    assert len(state.specs._specs) == 2


# ---------------------------------------------------------------------------------------------- ops
@pytest.mark.parametrize("spelling, name", [("SUM", "sum"), ("avg", "mean"), ("Product", "prod"), ("BXOR", "bxor"),
                                            (torch.distributed.ReduceOp.MAX, "max"),
                                            (torch.distributed.ReduceOp.AVG, "mean")])
def test_reduce_op_spellings(spelling, name):
    assert ops.parse_reduce_op(spelling) == name


def test_wire_and_result_dtypes():
    assert wire_and_result(torch.int16, "sum") == (torch.int32, torch.int16)
    assert wire_and_result(torch.int32, "mean") == (torch.int64, torch.get_default_dtype())
    assert wire_and_result(torch.int64, "mean", python_number=True) == (torch.int64, torch.float64)
    assert wire_and_result(torch.bool, "sum") == (torch.int64, torch.int64)
    assert wire_and_result(torch.bool, "band") == (torch.uint8, torch.bool)
    with pytest.raises(TypeError, match="cannot be reduced"):
        wire_and_result(torch.float8_e4m3fn, "sum")


def test_header_sizes_travel_in_units_and_too_large_is_refused():
    assert [units(n) for n in (0, 1, UNIT, UNIT + 1)] == [0, 1, 1, 2]
    assert units(MAX_SIZE * UNIT) == MAX_SIZE
    with pytest.raises(ValueError, match="split the data over several calls"):
        units(MAX_SIZE * UNIT + 1)


_CALLS = [Call(kind, op, root, flags, (d0, ~d0), fixed) for kind in range(1, 7) for op in (0, 1, 2)
          for root in (-1, 0, 3) for flags in (0, 1) for d0 in (0, 2**62, -5) for fixed in (0, 16, 2**40)]


def test_call_tags_are_never_reserved_and_tell_calls_apart():
    tags = [call_tag(c) for c in _CALLS]
    assert min(tags) > TAG_ERROR and max(tags) <= MAX_SIZE
    assert len(set(tags)) == len(_CALLS)


def test_call_tags_are_the_same_in_another_process():
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            "from test_collectives_single import _CALLS; "
            "from fabriclite.collectives.plans import call_tag; print(json.dumps([call_tag(c) for c in _CALLS]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == [call_tag(c) for c in _CALLS]


# ---------------------------------------------------------------------------------------------- pool
def test_pool_reuses_views_only_when_nothing_else_can_see_them():
    pool = Pool()
    first = pool.views(torch.tensor([1.0, 2.0]))
    first_ids = [id(v) for v in first]
    kept = first[0]
    del first
    second = pool.views(torch.tensor([3.0, 4.0]))  # `kept` still refers to a view: a new buffer
    assert kept.item() == 1.0 and [id(v) for v in second] != first_ids
    del kept
    third = pool.views(torch.tensor([5.0, 6.0]))  # the first buffer is free again: its views come back
    assert [id(v) for v in third] == first_ids and [v.item() for v in third] == [5.0, 6.0]
    array = third[1].numpy()  # shares the memory
    del third
    fourth = pool.views(torch.tensor([7.0, 8.0]))
    assert array.tolist() == 6.0 and [v.item() for v in fourth] == [7.0, 8.0]
    fourth[0].add_(1)  # changed in place: not reused
    ids = [id(v) for v in fourth]
    del fourth
    assert [id(v) for v in pool.views(torch.tensor([0.0, 0.0]))] != ids


@pytest.fixture(params=["C++ check", "Python check"])
def checks(request, monkeypatch):
    """The pool's and the uniform read's checks both ways: torch's one-pass C++ check (TensorGuards) where this
    torch has it, and the Python passes used where it does not."""
    from fabriclite.collectives import buffers

    if request.param == "C++ check":
        if buffers._TensorGuards is None:
            pytest.skip("this torch has no torch._C._dynamo.guards.TensorGuards")
    else:
        monkeypatch.setattr(buffers, "_TensorGuards", None)
    return request.param


@pytest.mark.parametrize("n", [2, 1000])
def test_pool_skips_views_someone_made_require_grad(checks, n):
    """The guarantee the pool's check keeps: a reused view never comes back requiring grad (whichever of
    the views got it), and a free slot's views do come back (the check is not just always false)."""
    pool = Pool()
    views = pool.views(torch.arange(float(n)))
    ids = [id(v) for v in views]
    del views
    again = pool.views(torch.arange(float(n)) + 1)  # nothing happened to them: the same views come back
    assert [id(v) for v in again] == ids and again[-1].item() == n
    for k in (0, n - 1):
        again[k].requires_grad_()
        del again
        again = pool.views(torch.arange(float(n)) + 2)
        assert [id(v) for v in again] != ids and not any(v.requires_grad for v in again), k
        assert [v.item() for v in again] == [float(i + 2) for i in range(n)]
        ids = [id(v) for v in again]


def test_pool_skips_views_whose_dims_changed_in_place(checks):
    """With the C++ check, a view whose number of dims changed in place (``unsqueeze_``) is not reused either."""
    if checks != "C++ check":
        pytest.skip("the Python check looks at requires_grad only")
    pool = Pool()
    views = pool.views(torch.zeros(10))
    views[3].unsqueeze_(0)
    ids = [id(v) for v in views]
    del views
    again = pool.views(torch.ones(10))
    assert [id(v) for v in again] != ids and all(v.dim() == 0 for v in again)


def test_collectives_module_keeps_its_public_names():
    for name in ("barrier", "broadcast", "all_gather", "all_reduce", "gather", "reduce", "rank_zero_first"):
        assert callable(getattr(collectives, name))


def test_a_uniform_collection_is_checked_in_one_pass_per_property(checks):
    """The one-pass key of a uniform collection: found by its structure, its dtypes, devices and dims compared,
    its values read (on the CPU: Python numbers, by ``item()``); any change of a leaf's dtype, shape, device,
    type or container falls back to the full key."""
    from fabriclite.collectives.structure import SpecCache

    cache = SpecCache()
    base = {f"m{i}": torch.tensor(float(i)) for i in range(5)}
    tree, leaves, spec, stacked = cache.take_apart(base, "reduce")
    assert stacked is None and spec.uniform == (torch.float32, torch.device("cpu"))  # first sight: the full key
    tree2, leaves2, spec2, stacked2 = cache.take_apart(dict(base), "reduce")
    assert spec2 is spec and tree2 == tree and stacked2 is not None
    assert stacked2 == [float(i) for i in range(5)]
    changed = {
        "dtype": torch.tensor(1.0, dtype=torch.float64),
        "shape": torch.ones(1),
        "shape 2-d": torch.ones(1, 1),
        "device": torch.tensor(1.0, device="meta"),
        "type": 1.0,
        "dtype-like object": type("FakeLeaf", (), {"dtype": torch.float32, "is_cpu": True})(),
        "container": {"x": torch.tensor(1.0)},
        "int": torch.tensor(1),
    }
    for what, leaf in changed.items():
        data = dict(base, m3=leaf)
        got_tree, got_leaves, other, again = cache.take_apart(data, "reduce")
        assert again is None and other is not spec and len(got_leaves) == 5, what
        if what == "container":  # another structure, uniform in its turn (every leaf still a 0-d float32)
            assert got_tree != tree and other.uniform is not None
        else:
            assert other.uniform is None, what
    assert cache.take_apart(dict(base), "reduce")[3] is not None  # and back


def test_a_uniform_collection_whose_leaves_require_grad_is_read_after_one_full_lookup(checks):
    """The uniform check compares requires_grad too (C++ check): leaves that now require grad go through the full
    key once, which makes the check again from them; the values read are the leaves' values either way."""
    from fabriclite.collectives.structure import SpecCache

    cache = SpecCache()
    base = {f"m{i}": torch.tensor(float(i)) for i in range(5)}
    cache.take_apart(base, "reduce")
    grad = {k: v.clone().requires_grad_() for k, v in base.items()}
    first = cache.take_apart(grad, "reduce")[3]
    assert (first is None) == (checks == "C++ check")
    assert cache.take_apart(grad, "reduce")[3] == [float(i) for i in range(5)]
