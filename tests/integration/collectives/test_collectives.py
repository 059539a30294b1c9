"""Collectives over collections on real ranks (a gloo group): the seeds' examples, the semantics, and every
failure case (the error on every rank, and the group usable right after)."""
from __future__ import annotations

import os
import pickle
import threading
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import torch

from fabriclite import collectives
from fabriclite.collectives import CollectiveMismatchError, RankZeroFailed

Pair = namedtuple("Pair", "first second")


@dataclass
class Stats:
    loss: torch.Tensor
    count: int


# ---------------------------------------------------------------------------------------------- helpers
def _errors_then_usable(fabric, fn):
    """Run ``fn``; return (error type, message) or None, then prove the group still works."""
    try:
        fn()
        outcome = None
    except Exception as err:  # noqa: BLE001 - the test inspects it
        outcome = (type(err).__name__, str(err))
    after = fabric.all_reduce(torch.tensor(1.0), reduce_op="sum").item()
    assert after == fabric.world_size
    return outcome


def _assert_same_error_everywhere(results, *fragments, kind="CollectiveMismatchError"):
    assert all(r is not None for r in results), results
    assert len({msg for _, msg in results}) == 1, results  # the same message on every rank
    name, msg = results[0]
    assert name == kind, results
    for fragment in fragments:
        assert fragment in msg, msg
    return msg


# ---------------------------------------------------------------------------------------------- seeds: Lightning
def _lightning_page(fabric):
    rank = fabric.global_rank
    out = {}
    learning_rate = torch.rand(1) + rank
    out["own_lr"] = learning_rate.item()
    out["broadcast"] = fabric.broadcast(learning_rate).item()
    out["broadcast_src"] = fabric.broadcast(torch.tensor([float(rank)]), src=3).item()
    out["all_gather"] = fabric.all_gather(torch.tensor(10 * rank)).tolist()
    out["all_reduce"] = fabric.all_reduce(torch.tensor(10 * rank), reduce_op="sum").item()
    out["all_reduce_mean"] = fabric.all_reduce(torch.tensor(10.0 * rank)).item()
    collection = {"loss": torch.tensor(float(rank)), "data": torch.arange(3) + rank}
    gathered = fabric.all_gather(collection)
    out["collection"] = {k: v.tolist() for k, v in gathered.items()}
    out["reduced_collection"] = {k: v.tolist() for k, v in fabric.all_reduce(collection).items()}
    fabric.barrier()
    return out


def test_lightning_collectives_page_on_four_ranks(pool4):
    results = pool4.run(_lightning_page)
    assert len({r["own_lr"] for r in results}) == 4  # every rank starts with its own value ...
    assert all(r["broadcast"] == results[0]["own_lr"] for r in results), results  # ... and ends with rank 0's
    assert all(r["broadcast_src"] == 3.0 for r in results)
    for r in results:
        assert r["all_gather"] == [0, 10, 20, 30]
        assert r["all_reduce"] == 60
        assert r["all_reduce_mean"] == 15.0
        assert r["collection"] == {"loss": [0.0, 1.0, 2.0, 3.0], "data": [[i, i + 1, i + 2] for i in range(4)]}
        assert r["reduced_collection"] == {"loss": 1.5, "data": [1.5, 2.5, 3.5]}  # int mean: not truncated


# ---------------------------------------------------------------------------------------------- seeds: Ignite
def _ignite_tutorial(fabric):
    rank = fabric.global_rank
    tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * rank
    reduced = fabric.all_reduce(tensor, reduce_op="SUM")
    gathered = fabric.all_gather(2.0 * rank)
    message = fabric.broadcast(f"hello from rank {rank}", src=0)
    # get_datasets(): the ranks reach their barriers at different places in the code
    if fabric.local_rank > 0:
        fabric.barrier()
    datasets = ("train", "test")
    if fabric.local_rank == 0:
        fabric.barrier()
    # compute_metric(): gather predictions, compute on rank 0, broadcast the result
    predictions = fabric.all_gather(torch.tensor([rank, rank + 1.0]))
    result = float(predictions.sum()) if rank == 0 else 0.0
    result = fabric.broadcast(result, src=0)
    return tensor.tolist(), reduced.tolist(), gathered.tolist(), gathered.dtype, message, datasets, result


def test_ignite_tutorial_on_three_ranks(pool3):
    results = pool3.run(_ignite_tutorial)
    assert [r[0] for r in results] == [[1, 2], [3, 4], [5, 6]]  # inputs untouched
    for _, reduced, gathered, dtype, message, datasets, result in results:
        assert reduced == [9, 12]
        assert gathered == [0.0, 2.0, 4.0] and dtype == torch.float64
        assert message == "hello from rank 0"
        assert datasets == ("train", "test")
        assert result == 0 + 1 + 1 + 2 + 2 + 3


# ---------------------------------------------------------------------------------------------- semantics
def _semantics(fabric):
    rank = fabric.global_rank
    out = {}
    big = 2 ** 60 + rank
    out["exact_int"] = fabric.all_reduce({"n": big}, reduce_op="sum")["n"].item()
    out["int_mean"] = fabric.all_reduce({"n": rank + 1, "t": torch.tensor([rank + 1])})
    out["bools"] = {op: fabric.all_reduce(torch.tensor(rank == 0), reduce_op=op).item()
                    for op in ("sum", "max", "min", "bxor")}
    out["ops"] = {op: fabric.all_reduce(torch.tensor(rank + 2), reduce_op=op).item()
                  for op in ("prod", "PRODUCT", "Min", "max", "band", "bor", "bxor", "avg")}
    out["reduce_op_enum"] = fabric.all_reduce(torch.tensor(1.0), reduce_op=torch.distributed.ReduceOp.SUM).item()
    data = {"t": torch.ones(3) * rank}
    fabric.all_reduce(data, reduce_op="sum")
    out["input_untouched"] = data["t"].tolist()
    out["strings"] = fabric.all_gather({"name": f"rank{rank}", "cfg": {"lr": 0.1 * rank}, "none": None})
    out["passthrough"] = fabric.all_reduce({"name": f"rank{rank}", "x": 1.0})["name"]
    # same keys, different insertion order: meet by key, come back in this rank's order
    items = [("a", torch.tensor(1.0 + rank)), ("b", torch.tensor(10.0)), ("c", 3)]
    ordered = OrderedDict(items if rank == 0 else reversed(items))
    reduced = fabric.all_reduce(ordered, reduce_op="sum")
    out["order"] = (type(reduced).__name__, list(reduced), {k: float(v) for k, v in reduced.items()})
    nested = {"pair": Pair(torch.tensor(rank), [1.5, (torch.ones(2), "s")]), "stats": Stats(torch.tensor(2.0), 3)}
    gathered = fabric.all_gather(nested)
    out["nested"] = (type(gathered["pair"]).__name__, gathered["pair"].first.tolist(),
                     gathered["pair"].second[0].tolist(), type(gathered["pair"].second[1]).__name__,
                     gathered["pair"].second[1][0].shape, gathered["pair"].second[1][1],
                     type(gathered["stats"]).__name__, gathered["stats"].loss.tolist(),
                     gathered["stats"].count.tolist())
    out["uneven_cat"] = fabric.all_gather({"x": torch.arange(rank + 1), "s": torch.tensor(rank)}, cat=True)
    out["gather"] = fabric.gather({"t": torch.arange(rank + 2), "n": rank}, dst=1)
    out["reduce"] = fabric.reduce({"t": torch.tensor([float(rank)])}, dst=0, reduce_op="sum")
    out["big_reduce"] = fabric.all_reduce(torch.full((50_000,), float(rank)), reduce_op="sum").unique().tolist()
    out["big_gather"] = fabric.all_gather(torch.full((40_000,), rank)).sum(1).tolist()
    out["big_broadcast"] = fabric.broadcast({"w": torch.arange(60_000) * (rank + 1), "k": "v"}, src=1)["w"][-1].item()
    out["devices"] = fabric.all_reduce({"n": 1})["n"].device.type
    return out


def test_semantics_on_two_ranks(pool2):
    r0, r1 = pool2.run(_semantics)
    for r in (r0, r1):
        assert r["exact_int"] == 2 ** 61 + 1
        assert r["int_mean"]["n"].item() == 1.5 and r["int_mean"]["n"].dtype == torch.float64
        assert r["int_mean"]["t"].tolist() == [1.5] and r["int_mean"]["t"].dtype == torch.get_default_dtype()
        assert r["bools"] == {"sum": 1, "max": True, "min": False, "bxor": True}
        assert r["ops"] == {"prod": 6, "PRODUCT": 6, "Min": 2, "max": 3, "band": 2, "bor": 3, "bxor": 1, "avg": 2.5}
        assert r["reduce_op_enum"] == 2.0
        assert r["strings"]["name"] == ["rank0", "rank1"] and r["strings"]["none"] == [None, None]
        assert r["strings"]["cfg"]["lr"].tolist() == [0.0, 0.1] and r["strings"]["cfg"]["lr"].dtype == torch.float64
        assert r["uneven_cat"]["x"].tolist() == [0, 0, 1] and r["uneven_cat"]["s"].tolist() == [0, 1]
        assert r["big_reduce"] == [1.0] and r["big_gather"] == [0, 40_000] and r["big_broadcast"] == 2 * 59_999
        assert r["devices"] == "cpu"
    assert r0["input_untouched"] == [0.0, 0.0, 0.0] and r1["input_untouched"] == [1.0, 1.0, 1.0]
    assert r0["passthrough"] == "rank0" and r1["passthrough"] == "rank1"
    assert r0["order"] == ("OrderedDict", ["a", "b", "c"], {"a": 3.0, "b": 20.0, "c": 6.0})
    assert r1["order"] == ("OrderedDict", ["c", "b", "a"], {"a": 3.0, "b": 20.0, "c": 6.0})
    assert r0["nested"] == ("Pair", [0, 1], [1.5, 1.5], "tuple", torch.Size([2, 2]), ["s", "s"], "Stats",
                            [2.0, 2.0], [3, 3])
    assert r0["gather"] is None
    assert [g["t"].tolist() for g in r1["gather"]] == [[0, 1], [0, 1, 2]] and [g["n"] for g in r1["gather"]] == [0, 1]
    assert r0["reduce"]["t"].tolist() == [1.0] and r1["reduce"] is None


def _results_are_fresh(fabric):
    """Results kept by the caller are never changed by later calls (result buffers are reused only when
    nothing else refers to them)."""
    rank = fabric.global_rank
    keys = [f"k{i}" for i in range(20)]
    kept = [fabric.all_reduce({k: torch.tensor(float(step + rank)) for k in keys}, reduce_op="sum")
            for step in range(5)]
    view = fabric.all_reduce({k: torch.tensor(7.0) for k in keys}, reduce_op="sum")["k3"].view(1)
    for step in range(4):
        fabric.all_reduce({k: torch.tensor(100.0) for k in keys}, reduce_op="sum")
    big = [fabric.all_reduce(torch.full((40_000,), float(step)), reduce_op="sum") for step in range(4)]
    return [float(d["k0"]) for d in kept], view.tolist(), [float(b[0]) for b in big]


def test_kept_results_never_change(pool2):
    for kept, view, big in pool2.run(_results_are_fresh):
        assert kept == [1.0, 3.0, 5.0, 7.0, 9.0]
        assert view == [14.0]
        assert big == [0.0, 2.0, 4.0, 6.0]


def _gathered_results_are_fresh(fabric):
    """all_gather of many 0-d leaves (keys whose sorted order is not the caller's): its result buffer is found and
    its result built while the header is exchanged; results kept are never changed, dropped ones are reused, and a
    result someone made require grad never comes back requiring it."""
    rank = fabric.global_rank
    keys = [f"k{i}" for i in range(20)]  # sorted: k0, k1, k10, ...: the wire order differs from the caller's
    def call(step):
        return fabric.all_gather({k: torch.tensor(100.0 * step + 10 * rank + i) for i, k in enumerate(keys)})
    kept = [call(step) for step in range(2)]  # two of the pool's three buffers stay in use
    ids = None
    for step in range(5, 9):  # dropped at once: the same views come back, with the new values
        out = call(step)
        assert list(out) == keys
        assert [out[k].tolist() for k in keys] == [[100.0 * step + i, 100.0 * step + 10 + i] for i in range(20)]
        now = [id(v) for v in out.values()]
        assert ids is None or now == ids, step
        ids = now
        del out
    out = call(9)
    out["k7"].requires_grad_()
    del out
    fresh = call(10)
    grads = [v.requires_grad for v in fresh.values()]
    return ([[d[k].tolist() for k in ("k0", "k7", "k19")] for d in kept], grads, [id(v) for v in fresh.values()] == ids,
            fresh["k19"].tolist())


def test_kept_gathered_results_never_change(pool2):
    for kept, grads, reused, last in pool2.run(_gathered_results_are_fresh):
        assert kept == [[[100.0 * s, 100.0 * s + 10], [100.0 * s + 7, 100.0 * s + 17], [100.0 * s + 19, 100.0 * s + 29]]
                        for s in range(2)]
        assert not any(grads) and not reused and last == [1019.0, 1029.0]


def _groups(fabric):
    rank = fabric.global_rank
    strategy = fabric.strategy
    if rank == 1:
        return None
    first = collectives.all_reduce(strategy, {"x": torch.tensor(rank + 1.0)}, group=[0, 2], reduce_op="sum")
    second = fabric.all_reduce({"x": torch.tensor(rank + 1.0)}, group=[2, 0], reduce_op="sum")
    gathered = fabric.all_gather(torch.tensor(rank), group=[0, 2])
    same_handle = strategy.resolve_group([0, 2]) is strategy.resolve_group((2, 0))
    return first["x"].item(), second["x"].item(), gathered.tolist(), same_handle


def test_group_as_a_list_of_ranks_is_cached(pool3):
    results = pool3.run(_groups)
    assert results[1] is None
    assert results[0] == results[2] == (4.0, 4.0, [0, 2], True)


def _sync_grads(fabric):
    rank = fabric.global_rank
    x = torch.tensor([rank + 1.0, 10.0], requires_grad=True)
    y = torch.arange(rank + 1.0, requires_grad=True)
    out = fabric.all_gather({"x": x, "n": 3}, sync_grads=True)
    loss = (out["x"] * (rank + 1)).sum()  # rank k weighs every rank's x by k + 1
    cat = fabric.all_gather(y, sync_grads=True, cat=True)
    loss = loss + (cat * (rank + 1)).sum()
    loss.backward()
    no_grad = fabric.all_gather(x)
    return x.grad.tolist(), y.grad.tolist(), no_grad.requires_grad, out["x"].shape


def test_all_gather_sync_grads_flow_to_every_rank(pool2):
    (gx0, gy0, ng0, shape0), (gx1, gy1, _, _) = pool2.run(_sync_grads)
    assert gx0 == gx1 == [3.0, 3.0]  # (0 + 1) + (1 + 1)
    assert gy0 == [3.0] and gy1 == [3.0, 3.0]
    assert ng0 is False and shape0 == (2, 2)


# ---------------------------------------------------------------------------------------------- failures
def _different_keys(fabric):
    rank = fabric.global_rank
    data = {"loss": torch.tensor(1.0), ("acc" if rank == 0 else "accuracy"): torch.tensor(0.5)}
    return _errors_then_usable(fabric, lambda: fabric.all_reduce(data))


def _different_shapes(fabric):
    rank = fabric.global_rank
    return _errors_then_usable(fabric, lambda: fabric.all_gather({"preds": torch.zeros(3 + rank, 2)}))


def _different_dtypes(fabric):
    dtype = torch.float32 if fabric.global_rank == 0 else torch.float64
    return _errors_then_usable(fabric, lambda: fabric.all_reduce({"x": torch.zeros(2, dtype=dtype)}))


def _different_collectives(fabric):
    data = {"x": torch.tensor(1.0)}
    if fabric.global_rank == 0:
        return _errors_then_usable(fabric, lambda: fabric.all_reduce(data, reduce_op="sum"))
    return _errors_then_usable(fabric, lambda: fabric.all_gather(data))


def _different_ops(fabric):
    op = "sum" if fabric.global_rank == 0 else "max"
    return _errors_then_usable(fabric, lambda: fabric.all_reduce(torch.ones(2), reduce_op=op))


def _bad_op_on_one_rank(fabric):
    op = "sum" if fabric.global_rank == 0 else "median"
    return _errors_then_usable(fabric, lambda: fabric.all_reduce(torch.ones(2), reduce_op=op))


def _bitwise_on_floats(fabric):
    return _errors_then_usable(fabric, lambda: fabric.all_reduce({"f": torch.ones(2)}, reduce_op="band"))


def _bad_src(fabric):
    return _errors_then_usable(fabric, lambda: fabric.broadcast("x", src=7))


def _different_src(fabric):
    return _errors_then_usable(fabric, lambda: fabric.broadcast("x", src=fabric.global_rank))


def _unpicklable_on_one_rank(fabric):
    leaf = threading.Lock() if fabric.global_rank == 1 else "fine"
    return _errors_then_usable(fabric, lambda: fabric.all_gather({"obj": leaf}))


def _unpicklable_broadcast(fabric):
    return _errors_then_usable(fabric, lambda: fabric.broadcast({"lock": threading.Lock()}, src=0))


def _bad_dst(fabric):
    return _errors_then_usable(fabric, lambda: fabric.gather(torch.ones(1), dst=-1))


def _number_vs_tensor(fabric):
    value = 1.0 if fabric.global_rank == 0 else torch.tensor(1.0)
    return _errors_then_usable(fabric, lambda: fabric.all_reduce({"x": value}))


def test_different_keys_fail_on_every_rank(pool2):
    msg = _assert_same_error_everywhere(pool2.run(_different_keys), "all_reduce", "['acc'] is on ranks [0]",
                                        "['accuracy'] is on ranks [1]")
    assert "insertion order does not matter" in msg


def test_different_shapes_list_every_ranks_shape(pool2):
    _assert_same_error_everywhere(pool2.run(_different_shapes), "rank 0 has a float32 tensor of shape (3, 2)",
                                  "rank 1 has a float32 tensor of shape (4, 2)", "cat=True")


def test_different_dtypes_fail(pool2):
    _assert_same_error_everywhere(pool2.run(_different_dtypes), "rank 0 has a float32", "rank 1 has a float64")


def test_different_collectives_fail(pool2):
    _assert_same_error_everywhere(pool2.run(_different_collectives), "rank 0: all_reduce(reduce_op='sum')",
                                  "rank 1: all_gather(cat=False)")


def test_different_reduce_ops_fail(pool2):
    _assert_same_error_everywhere(pool2.run(_different_ops), "reduce_op='sum'", "reduce_op='max'")


def test_bad_reduce_op_on_one_rank_fails_on_every_rank(pool2):
    _assert_same_error_everywhere(pool2.run(_bad_op_on_one_rank), "rank 1: ValueError: reduce_op='median'")


def test_bitwise_op_on_floats_fails(pool2):
    _assert_same_error_everywhere(pool2.run(_bitwise_on_floats), "['f']", "needs integer or bool leaves")


def test_src_out_of_range_is_a_value_error_everywhere(pool2):
    results = pool2.run(_bad_src)
    _assert_same_error_everywhere(results, "src=7 is out of range")
    assert issubclass(CollectiveMismatchError, ValueError)


def test_different_src_fails(pool2):
    _assert_same_error_everywhere(pool2.run(_different_src), "broadcast(src=0)", "broadcast(src=1)")


def test_unpicklable_leaf_on_one_rank_fails_on_every_rank(pool2):
    _assert_same_error_everywhere(pool2.run(_unpicklable_on_one_rank), "rank 1: TypeError")


def test_unpicklable_broadcast_fails_on_every_rank(pool2):
    _assert_same_error_everywhere(pool2.run(_unpicklable_broadcast), "rank 0: TypeError")


def test_dst_out_of_range_fails(pool2):
    _assert_same_error_everywhere(pool2.run(_bad_dst), "dst=-1 is out of range")


def test_number_against_tensor_fails(pool2):
    _assert_same_error_everywhere(pool2.run(_number_vs_tensor), "rank 0 has a Python float",
                                  "rank 1 has a float32 tensor")


def test_mismatch_on_three_ranks(pool3):
    _assert_same_error_everywhere(pool3.run(_different_shapes), "rank 2 has a float32 tensor of shape (5, 2)")


# ---------------------------------------------------------------------------------------------- rank_zero_first
def _rank_zero_first(fabric, path):
    import torch.distributed.distributed_c10d as c10d

    groups_before = getattr(c10d._world, "group_count", None)
    order = []
    for _ in range(3):
        with fabric.rank_zero_first():
            if fabric.global_rank == 0 and not os.path.exists(path):
                with open(path, "w") as f:
                    f.write("downloaded")
            order.append(open(path).read())
    with fabric.rank_zero_first(local=True):
        order.append("local")

    def failing():
        with fabric.rank_zero_first():
            if fabric.global_rank == 0:
                raise OSError("download failed: disk full")
            order.append("ran the block")
    outcome = _errors_then_usable(fabric, failing)
    return order, outcome, getattr(c10d._world, "group_count", None) == groups_before


def test_rank_zero_first_runs_rank_zero_first_and_shares_its_error(pool2, tmp_path):
    (order0, err0, same0), (order1, err1, same1) = pool2.run(_rank_zero_first, str(tmp_path / "data.txt"))
    assert order0 == order1 == ["downloaded"] * 3 + ["local"]
    assert err0 == ("OSError", "download failed: disk full")
    assert err1[0] == RankZeroFailed.__name__ and "OSError: download failed: disk full" in err1[1]
    assert same0 and same1  # no process group per call


# ---------------------------------------------------------------------------------------------- torchmetrics
def _torchmetrics(fabric):
    import torchmetrics

    rank = fabric.global_rank
    strategy = fabric.strategy

    def sync(tensor, group=None):
        return list(collectives.all_gather(strategy, tensor, group=group).unbind(0))

    mean = torchmetrics.MeanMetric(dist_sync_fn=sync)
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    for step in range(3):
        mean.update(torch.tensor([float(rank * 10 + step)]))
        preds = torch.tensor([rank % 3, step % 3])
        accuracy.update(preds, torch.tensor([0, step % 3]))
    return mean.compute().item(), accuracy.compute().item()


def test_torchmetrics_computes_global_values_over_the_group(pool2):
    results = pool2.run(_torchmetrics)
    # means of 0, 1, 2 and 10, 11, 12; rank 0 is right 6 of 6 times, rank 1 3 of 6
    assert results == [(6.0, 0.75), (6.0, 0.75)]


# ---------------------------------------------------------------------------------------------- unchecked
def _unchecked(fabric):
    strategy = fabric.strategy
    rank = fabric.global_rank
    data = {"a": torch.tensor(float(rank)), "b": [rank, torch.ones(2)]}
    reduced = collectives.all_reduce(strategy, data, reduce_op="sum", check=False)
    gathered = collectives.all_gather(strategy, data, check=False)
    message = collectives.broadcast(strategy, {"t": torch.arange(3) + rank}, src=1, check=False)
    collectives.barrier(strategy, check=False)
    return reduced["a"].item(), reduced["b"][0].item(), gathered["b"][1].tolist(), message["t"].tolist()


def test_check_false_skips_the_header(pool2):
    for result in pool2.run(_unchecked):
        assert result == (1.0, 1, [[1.0, 1.0], [1.0, 1.0]], [1, 2, 3])


def test_errors_are_picklable_for_the_pool():
    err = CollectiveMismatchError("x")
    assert isinstance(pickle.loads(pickle.dumps(err)), ValueError)


# ---------------------------------------------------------------------------------------------- header widths
def _collectives_per_call(fabric, fn, calls=3):
    """Primitive collectives entered per call of ``fn`` (the strategy's own per-group counter), after the
    group's header has settled on a width for it."""
    counts = fabric.strategy._watch.counts
    key = tuple(range(fabric.world_size))
    fn()
    before = counts.get(key, 0)
    for _ in range(calls):
        fn()
    return (counts[key] - before) / calls


def _widths(fabric):
    rank = fabric.global_rank
    one = {"loss": torch.tensor(1.0 + rank)}
    ten = {f"m{i}": torch.tensor(float(i * (rank + 1))) for i in range(10)}
    many = {f"k{i}": torch.tensor(float(i + rank)) for i in range(3000)}  # 12 KB: more than a header holds
    counts = {
        "1 leaf": _collectives_per_call(fabric, lambda: fabric.all_reduce(one)),
        "10 leaves": _collectives_per_call(fabric, lambda: fabric.all_reduce(ten, reduce_op="sum")),
        "3000 leaves": _collectives_per_call(fabric, lambda: fabric.all_reduce(many, reduce_op="sum")),
        "barrier": _collectives_per_call(fabric, fabric.barrier),
        "small broadcast": _collectives_per_call(fabric, lambda: fabric.broadcast({"lr": 0.1, "tag": "x"}, src=1)),
    }
    # every width change keeps every kind of call right: alternate sizes and kinds on one group
    checks = []
    for size in (1, 3, 300, 1, 5000, 2, 40, 1):
        data = {f"v{i}": torch.tensor(float(i + 10 * rank)) for i in range(size)}
        reduced = fabric.all_reduce(data, reduce_op="sum")
        checks.append(all(reduced[f"v{i}"].item() == 2 * i + 10 for i in range(size)))
        gathered = fabric.all_gather(data)
        checks.append(all(gathered[f"v{i}"].tolist() == [i, i + 10] for i in range(size)))
        uneven = fabric.all_gather(torch.arange(size * (rank + 1)), cat=True)
        checks.append(uneven.tolist() == list(range(size)) + list(range(2 * size)))
        message = fabric.broadcast({"text": "y" * size * 3, "t": torch.arange(size)} if rank == 1 else None, src=1)
        checks.append(message["text"] == "y" * size * 3 and message["t"].tolist() == list(range(size)))
        everyone = fabric.gather({"rank": rank, "name": "r" * (size % 7)}, dst=0)
        checks.append(rank != 0 or everyone == [{"rank": r, "name": "r" * (size % 7)} for r in range(2)])
        fabric.barrier()
    return counts, checks


def test_small_calls_are_one_collective_and_widths_follow_the_data(pool2):
    for counts, checks in pool2.run(_widths):
        assert all(checks), checks
        assert counts == {"1 leaf": 1, "10 leaves": 1, "3000 leaves": 2, "barrier": 1, "small broadcast": 1}, counts


def _width_mismatch(fabric):
    # after a wide call, the ranks' calls differ in size and kind: the header widths stay in step (every
    # call before agreed), so the call that does not pair up raises on every rank, and the next one works
    rank = fabric.global_rank
    big = {f"k{i}": torch.tensor(1.0) for i in range(500)}
    fabric.all_reduce(big)
    outcome = _errors_then_usable(fabric, lambda: fabric.all_reduce(big if rank == 0 else 1.0))
    after = fabric.all_reduce(big, reduce_op="sum")
    return outcome, after["k7"].item()


def test_a_call_that_does_not_pair_up_after_a_width_change_fails_everywhere(pool2):
    results = pool2.run(_width_mismatch)
    _assert_same_error_everywhere([r[0] for r in results], "all_reduce")
    assert [r[1] for r in results] == [2.0, 2.0]


def _header_widths(fabric):
    from fabriclite.collectives.state import state_of

    widths = []
    for _ in range(10):  # a row of 1,000 floats sets a wide header
        fabric.all_reduce({f"k{i}": torch.tensor(1.0) for i in range(1000)})
    header = next(iter(state_of(fabric.strategy).headers.values()))
    widths.append(header.width)
    results = []
    for step in range(12):  # one float32 leaf: 4 bytes, the width-1 form's payload
        results.append(fabric.all_reduce({"loss": torch.tensor(float(step + fabric.global_rank))}, reduce_op="sum"))
        widths.append(header.width)
    return widths, [r["loss"].item() for r in results]


def test_one_leaf_goes_back_to_the_width_one_header(pool2):
    """After wide calls, a one-leaf all_reduce (4 bytes) returns the group to the width-1 header (one int64 SUM
    all_reduce of a word per rank) once the wide calls leave the history, instead of staying on an all_gather."""
    for widths, values in pool2.run(_header_widths):
        assert widths[0] > 1 and widths[-1] == 1, widths
        assert values == [2.0 * step + 1 for step in range(12)]
