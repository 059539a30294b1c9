"""``all_reduce(inplace=True)`` and ``reduce(inplace=True)`` on real ranks: every op and dtype, each path a
bucket can take (inline 0-d leaves, a single tensor reduced where it is, packed buckets copied back, a
non-contiguous tensor), checked against plain torch over every rank's input; the results that cannot be
in place (integer and bool means, bool sums) raise on every rank before anything is written."""
from __future__ import annotations

import pytest
import torch

from fabriclite import Fabric, collectives

OPS = ("sum", "mean", "min", "max", "prod", "band", "bor", "bxor")
DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)
SHAPES = {"scalar": (), "vector": (5,), "big": (70_000,)}


def _value(rank: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """Rank ``rank``'s input: small integers (products over three ranks fit int8), or bools."""
    numel = 1
    for s in shape:
        numel *= s
    base = torch.arange(numel).reshape(shape) % 3 + 1 + rank
    if dtype == torch.bool:
        return (base % 2 == 0).reshape(shape)
    return base.to(dtype)


def _reference(inputs, op: str) -> torch.Tensor:
    """Plain torch over every rank's input (a float mean: the sum divided by the number of ranks)."""
    stacked = torch.stack(inputs)
    if op in ("sum", "mean"):
        total = stacked.sum(0, dtype=stacked.dtype)
        return total / len(inputs) if op == "mean" else total
    if op == "min":
        return stacked.amin(0) if stacked.dtype != torch.bool else stacked.all(0)
    if op == "max":
        return stacked.amax(0) if stacked.dtype != torch.bool else stacked.any(0)
    if op == "prod":
        return stacked.prod(0, dtype=stacked.dtype) if stacked.dtype != torch.bool else stacked.all(0)
    fn = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
    out = inputs[0].clone()
    for x in inputs[1:]:
        out = fn(out, x)
    return out


def _applies(dtype: torch.dtype, op: str) -> bool:
    """Whether ``op`` is defined for ``dtype`` at all (inplace or not)."""
    if dtype.is_complex:
        return op in ("sum", "mean")
    if dtype.is_floating_point:
        return op not in ("band", "bor", "bxor")
    return True


def _in_place_possible(dtype: torch.dtype, op: str) -> bool:
    if dtype == torch.bool:
        return op not in ("sum", "mean")
    return not (op == "mean" and not (dtype.is_floating_point or dtype.is_complex))


def _every_op_and_dtype(fabric):
    """For each op, dtype and shape: (reduced values, the tensor objects came back, the error if any)."""
    rank = fabric.global_rank
    out = {}
    for op in OPS:
        for dtype in DTYPES:
            if not _applies(dtype, op):
                continue
            for name, shape in SHAPES.items():
                if name == "big" and dtype not in (torch.float32, torch.int64, torch.bool):
                    continue
                t = _value(rank, dtype, shape)
                key = (op, str(dtype), name)
                try:
                    result = fabric.all_reduce(t, reduce_op=op, inplace=True)
                except ValueError as err:
                    out[key] = ("error", str(err), t.equal(_value(rank, dtype, shape)))
                    continue
                out[key] = ("ok", result is t, t.clone())
    return out


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_op_and_dtype_in_place(ranks, pool2, pool3):
    pool = pool2 if ranks == 2 else pool3
    results = pool.run(_every_op_and_dtype)
    checked = 0
    for key in results[0]:
        op, dtype_name, shape_name = key
        dtype = getattr(torch, dtype_name.replace("torch.", ""))
        shape = SHAPES[shape_name]
        if not _in_place_possible(dtype, op):
            for r in results:
                status, message, untouched = r[key]
                assert status == "error", (key, r[key])
                assert "inplace=True" in message and "cannot hold" in message, message
                assert untouched, key  # nothing written before the error
            assert len({r[key][1] for r in results}) == 1  # the same message on every rank
            continue
        expected = _reference([_value(r, dtype, shape) for r in range(ranks)], op)
        for r in results:
            status, same_object, value = r[key]
            assert status == "ok", (key, r[key])
            assert same_object, key  # the caller's own tensor came back
            assert value.dtype == dtype and value.shape == shape, key
            assert torch.equal(value, expected.to(dtype)), (key, value, expected)
        checked += 1
    assert checked > 100


def _collections(fabric):
    rank = fabric.global_rank
    out = {}
    # several buckets (float32, int64, float64 numbers, a bool), a non-contiguous tensor, objects, numbers
    data = {"b": torch.tensor([True, rank == 0]), "f": torch.ones(2, 3) * (rank + 1),
            "t": (torch.arange(12.0).reshape(3, 4) * (rank + 1)).t(), "i": torch.tensor([rank, 5], dtype=torch.int64),
            "n": rank + 1, "x": 0.5, "name": f"rank{rank}", "s": torch.tensor(float(rank))}
    tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
    result = fabric.all_reduce(data, reduce_op="max", inplace=True)
    out["same"] = {k: result[k] is v for k, v in tensors.items()}
    out["values"] = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in result.items()}
    out["types"] = {k: type(v).__name__ for k, v in result.items()}
    out["order"] = list(result)
    # mean of floats on every path, with check=False too
    floats = {"a": torch.tensor(2.0 * rank), "v": torch.full((4,), 4.0 * rank), "big": torch.full((40_000,), 1.0 + rank)}
    for check in (True, False):
        copy = {k: v.clone() for k, v in floats.items()}
        back = collectives.all_reduce(fabric.strategy, copy, reduce_op="mean", check=check, inplace=True)
        out[f"mean check={check}"] = ({k: back[k] is copy[k] for k in copy},
                                      {k: v.unique().tolist() for k, v in copy.items()})
    # a large tensor (DDP divides and reduces it in chunks, each divided while the ones before are reduced)
    huge = torch.full((1_100_000,), 2.0 * (rank + 1))
    back = fabric.all_reduce({"huge": huge}, inplace=True)
    out["huge"] = (back["huge"] is huge, huge.unique().tolist())
    # reduce: the result on dst only, every rank's tensors reduced
    r = {"w": torch.tensor([1.0, 2.0]) * (rank + 1)}
    got = fabric.reduce(r, dst=1, reduce_op="sum", inplace=True)
    out["reduce"] = (got is None, None if got is None else got["w"] is r["w"], r["w"].tolist())
    # an integer mean in a collection: raised on every rank, and no tensor changed (nothing half-written)
    bad = {"a": torch.tensor([1.0, 2.0]) + rank, "count": torch.tensor([3, 4]) + rank}
    try:
        fabric.all_reduce(bad, inplace=True)
        out["bad"] = None
    except ValueError as err:
        out["bad"] = (type(err).__name__, str(err), bad["a"].tolist(), bad["count"].tolist())
    out["after"] = fabric.all_reduce(torch.tensor(1.0), reduce_op="sum").item()
    return out


def test_collections_in_place_on_two_ranks(pool2):
    results = pool2.run(_collections)
    for rank, r in enumerate(results):
        assert r["same"] == {"b": True, "f": True, "t": True, "i": True, "s": True}
        values = r["values"]
        assert values["b"] == [True, True]
        assert values["f"] == [[2.0] * 3] * 2
        assert values["t"] == (torch.arange(12.0).reshape(3, 4) * 2).t().tolist()
        assert values["i"] == [1, 5] and values["n"] == 2 and values["x"] == 0.5 and values["s"] == 1.0
        assert values["name"] == f"rank{rank}"  # objects as they were
        assert r["types"]["n"] == "Tensor" and r["types"]["name"] == "str"
        assert r["order"] == ["b", "f", "t", "i", "n", "x", "name", "s"]
        for check in (True, False):
            same, uniques = r[f"mean check={check}"]
            assert all(same.values()), same
            assert uniques == {"a": [1.0], "v": [2.0], "big": [1.5]}
        assert r["huge"] == (True, [3.0])
        assert r["reduce"] == ((rank != 1), (None if rank != 1 else True), [3.0, 6.0])
        name, message, a, count = r["bad"]
        assert name == "CollectiveMismatchError"
        assert "['count']" in message and "int64" in message and "inplace=True" in message, message
        assert a == [1.0 + rank, 2.0 + rank] and count == [3 + rank, 4 + rank]
        assert r["after"] == 2.0
    assert len({r["bad"][1] for r in results}) == 1


def test_in_place_in_one_process():
    fabric = Fabric(accelerator="cpu", devices=1)
    t = torch.tensor([1.0, 2.0])
    out = fabric.all_reduce({"t": t, "n": 3}, inplace=True)
    assert out["t"] is t and t.tolist() == [1.0, 2.0]
    assert out["n"].dtype == torch.float64 and out["n"].item() == 3.0
    with pytest.raises(ValueError, match=r"inplace=True: the mean of <root> \(int64 tensor\) is float32"):
        fabric.all_reduce(torch.tensor([1, 2]), inplace=True)
    assert fabric.reduce(t, reduce_op="sum", inplace=True) is t
