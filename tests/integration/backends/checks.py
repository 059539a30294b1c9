"""Checks run inside a launched job, on every rank, against a real backend (Horovod, XLA, MPI+gloo).

Each check computes everything it needs from all ranks first (every rank issues the same collectives in the same
order, whatever its results) and asserts afterwards, so a failing check cannot leave another rank waiting.
:func:`run` writes ``{check: "ok" | traceback}`` per rank to ``<out>/rank<r>.json`` for the pytest side to read.
"""
from __future__ import annotations

import json
import os
import time
import traceback
from collections import namedtuple
from typing import Any, Callable, Dict, List, Sequence

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CHECKS: Dict[str, Callable[[Any, str], None]] = {}
Pair = namedtuple("Pair", ["x", "y"])


def check(fn: Callable[[Any, str], None]) -> Callable[[Any, str], None]:
    CHECKS[fn.__name__] = fn
    return fn


def run(fabric: Any, names: Sequence[str], out: str) -> Dict[str, str]:
    """Run ``names`` in order on this rank; write and return the results."""
    results: Dict[str, str] = {}
    os.makedirs(out, exist_ok=True)
    for name in names:
        print(f"[check] rank {fabric.global_rank}: {name}", flush=True)
        try:
            CHECKS[name](fabric, out)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - recorded for the pytest side
            results[name] = traceback.format_exc()
    with open(os.path.join(out, f"rank{fabric.global_rank}.json"), "w") as f:
        json.dump(results, f)
    return results


def cpu(data: Any) -> Any:
    return apply_to_collection(data, torch.Tensor, lambda t: t.detach().cpu())


def close(a: Any, b: Any) -> bool:
    return torch.allclose(torch.as_tensor(a).double(), torch.as_tensor(b).double(), rtol=1e-6, atol=1e-6)


def data_of(rank: int) -> Dict[str, Any]:
    """Rank-derived nested data: tensors of several dtypes and shapes, Python numbers, a string."""
    return {
        "loss": torch.tensor(1.5 + rank),
        "vec": torch.arange(3, dtype=torch.float64) * (rank + 1),
        "ints": [torch.tensor([rank + 2, 7], dtype=torch.int64), rank + 1],
        "pair": Pair(torch.full((2, 2), float(rank - 1)), 0.25 * (rank + 1)),
        "name": f"rank-{rank}",
    }


@check
def rank_properties(fabric: Any, out: str) -> None:
    world, rank = fabric.world_size, fabric.global_rank
    ranks = fabric.strategy.all_gather_object((rank, fabric.local_rank, fabric.node_rank))
    expected = int(os.environ.get("FABRICLITE_EXPECT_WORLD", world))
    assert world == expected, (world, expected)
    assert [r[0] for r in ranks] == list(range(world)), ranks
    assert fabric.is_global_zero == (rank == 0)
    assert 0 <= fabric.local_rank < world and fabric.node_rank == 0, ranks


@check
def all_reduce_nested(fabric: Any, out: str) -> None:
    world, rank = fabric.world_size, fabric.global_rank
    got = {op: cpu(fabric.all_reduce(data_of(rank), reduce_op=op)) for op in ("sum", "mean", "min", "max", "prod")}
    every = [data_of(r) for r in range(world)]
    for op, fold in (("sum", torch.sum), ("min", lambda t, dim: t.min(dim).values),
                     ("max", lambda t, dim: t.max(dim).values), ("prod", torch.prod)):
        res = got[op]
        assert close(res["loss"], fold(torch.stack([d["loss"] for d in every]), dim=0)), (op, res)
        assert close(res["vec"], fold(torch.stack([d["vec"] for d in every]), dim=0)), (op, res)
        assert close(res["ints"][0], fold(torch.stack([d["ints"][0] for d in every]), dim=0)), (op, res)
        assert res["ints"][0].dtype == torch.int64 and res["name"] == f"rank-{rank}", (op, res)
        assert isinstance(res["pair"], Pair) and close(res["pair"].x, fold(torch.stack([d["pair"].x for d in every]), dim=0))
    mean = got["mean"]
    assert close(mean["ints"][1], sum(r + 1 for r in range(world)) / world) and mean["ints"][1].is_floating_point()
    assert close(mean["vec"], torch.stack([d["vec"] for d in every]).mean(0)), mean


@check
def all_reduce_bitwise(fabric: Any, out: str) -> None:
    world, rank = fabric.world_size, fabric.global_rank
    value = lambda r: {"i": torch.tensor([r + 1, 6, 1 << r], dtype=torch.int64), "b": torch.tensor([True, r == 0])}
    got = {op: cpu(fabric.all_reduce(value(rank), reduce_op=op)) for op in ("band", "bor", "bxor")}
    folds = {"band": lambda a, b: a & b, "bor": lambda a, b: a | b, "bxor": lambda a, b: a ^ b}
    for op, fold in folds.items():
        exp_i, exp_b = value(0)["i"], value(0)["b"]
        for r in range(1, world):
            exp_i, exp_b = fold(exp_i, value(r)["i"]), fold(exp_b, value(r)["b"])
        assert torch.equal(got[op]["i"], exp_i) and torch.equal(got[op]["b"], exp_b), (op, got[op], exp_i, exp_b)


@check
def all_reduce_inplace(fabric: Any, out: str) -> None:
    """``inplace=True``: the caller's tensors hold the result and come back as the same objects; a small leaf (the
    header path), a large one (reduced where it is, or copied back where the backend cannot) and a mean."""
    world, rank = fabric.world_size, fabric.global_rank
    small, big = torch.tensor([1.0, 2.0, 3.0]), torch.arange(300_000, dtype=torch.float32)  # big: beyond inline
    data = {"small": (small * (rank + 1)).to(fabric.device), "big": (big * (rank + 1)).to(fabric.device),
            "n": rank + 1}
    mine = (data["small"], data["big"])
    res = fabric.all_reduce(data, reduce_op="sum", inplace=True)
    total = sum(r + 1 for r in range(world))
    assert res["small"] is mine[0] and res["big"] is mine[1], "inplace=True must hand back the caller's tensors"
    assert torch.equal(mine[0].cpu(), small * total) and torch.equal(mine[1].cpu(), big * total), (mine[0], mine[1])
    assert int(res["n"]) == total, res["n"]
    x = torch.full((4,), float(2 * rank)).to(fabric.device)
    mean = fabric.all_reduce(x, reduce_op="mean", inplace=True)
    assert mean is x and close(x.cpu(), torch.full((4,), float(world - 1))), x


@check
def all_gather_nested(fabric: Any, out: str) -> None:
    world, rank = fabric.world_size, fabric.global_rank
    res = cpu(fabric.all_gather(data_of(rank)))
    every = [data_of(r) for r in range(world)]
    if world == 1 and res["vec"].dim() == 1:  # Lightning's world-size-1 contract: leaves come back as they are
        res = apply_to_collection(res, torch.Tensor, lambda t: t.unsqueeze(0))
    assert res["vec"].shape == (world, 3) and torch.equal(res["vec"], torch.stack([d["vec"] for d in every]))
    assert torch.equal(res["pair"].x, torch.stack([d["pair"].x for d in every]))
    assert torch.equal(res["ints"][1], torch.tensor([r + 1 for r in range(world)])), res["ints"][1]
    assert res["name"] == [f"rank-{r}" for r in range(world)], res["name"]


@check
def all_gather_uneven_cat(fabric: Any, out: str) -> None:
    world, rank = fabric.world_size, fabric.global_rank
    res = cpu(fabric.all_gather({"x": torch.arange(rank + 1) + 10 * rank, "m": torch.ones(rank + 1, 2) * rank},
                                cat=True))
    assert torch.equal(res["x"], torch.cat([torch.arange(r + 1) + 10 * r for r in range(world)])), res
    assert res["m"].shape == (world * (world + 1) // 2, 2), res["m"].shape


@check
def broadcast_and_objects(fabric: Any, out: str) -> None:
    world, rank = fabric.world_size, fabric.global_rank
    src = world - 1
    nested = cpu(fabric.broadcast(data_of(rank), src=src))
    # rank 0 sends a dict while the others pass None: a different Python type on each rank (Horovod's trap)
    config = fabric.broadcast({"lr": 0.1, "tags": ["a", "b"]} if rank == 0 else None, src=0)
    text = fabric.broadcast("hello" if rank == 0 else 12345, src=0)
    gathered = fabric.strategy.all_gather_object({"rank": rank, "pad": "x" * (100 * rank)})
    assert torch.equal(nested["vec"], data_of(src)["vec"]) and nested["name"] == f"rank-{src}", nested
    assert config == {"lr": 0.1, "tags": ["a", "b"]} and text == "hello", (config, text)
    assert [g["rank"] for g in gathered] == list(range(world)) and len(gathered[-1]["pad"]) == 100 * (world - 1)


@check
def gather_reduce_barrier(fabric: Any, out: str) -> None:
    world, rank = fabric.world_size, fabric.global_rank
    gathered = fabric.gather({"r": torch.tensor([rank])}, dst=0)
    reduced = fabric.reduce(torch.tensor([float(rank)]), dst=world - 1, reduce_op="sum")
    fabric.barrier()
    if rank == 0:
        assert [int(g["r"]) for g in cpu(gathered)] == list(range(world)), gathered
    else:
        assert gathered is None, gathered
    if rank == world - 1:
        assert close(cpu(reduced), [sum(range(world))]), reduced


def _wait_for(paths: List[str], deadline_s: float, every: bool = True) -> bool:
    """Whether every path (or, with ``every=False``, any) exists within ``deadline_s`` (polled: other processes or
    threads create them)."""
    end, test = time.monotonic() + deadline_s, (all if every else any)
    while not test(os.path.exists(p) for p in paths):
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


@check
def rank_zero_first_order(fabric: Any, out: str) -> None:
    """Rank 0's block ends before any other rank's block starts, observed through files (a shared folder), not
    clocks. The other ranks announce they are about to enter; rank 0, inside its block, waits for every
    announcement and then watches for half a second that no other rank entered its block (were the others not
    held back, they would be inside by then), and only then marks its block done; each other rank checks, inside
    its block, that the mark is there. Horovod and XLA run this without a store (the broadcast path)."""
    world, rank = fabric.world_size, fabric.global_rank
    path = lambda what, r: os.path.join(out, f"zero-first-{world}-{what}-{r}")  # noqa: E731
    others = range(1, world)
    if rank != 0:
        open(path("waiting", rank), "w").close()
    found: Dict[str, Any] = {}
    with fabric.rank_zero_first():
        if rank == 0:
            found["announced"] = _wait_for([path("waiting", r) for r in others], 120)
            found["entered_early"] = world > 1 and _wait_for([path("entered", r) for r in others], 0.5, every=False)
            open(path("done", 0), "w").close()
        else:
            found["done_seen"] = os.path.exists(path("done", 0))
            open(path("entered", rank), "w").close()
    fabric.barrier()
    if rank == 0:
        assert found["announced"], "the other ranks never reached rank_zero_first"
        assert not found["entered_early"], "another rank entered its block while rank 0 was in its own"
    else:
        assert found["done_seen"], f"rank {rank} entered its block before rank 0's block ended"


@check
def rank_zero_first_failure(fabric: Any, out: str) -> None:
    """Rank 0's block raises: rank 0 gets its own error, every other rank RankZeroFailed naming it without running
    its block, and the group still works afterwards."""
    from fabriclite.collectives import RankZeroFailed

    world, rank = fabric.world_size, fabric.global_rank
    ran, caught = False, None
    try:
        with fabric.rank_zero_first():
            if rank == 0:
                raise ValueError("rank 0's block fails on purpose")
            ran = True
    except Exception as err:  # noqa: BLE001 - inspected below
        caught = err
    after = cpu(fabric.all_reduce(torch.tensor([1.0]), reduce_op="sum"))
    if rank == 0:
        assert type(caught) is ValueError and "fails on purpose" in str(caught), repr(caught)
    else:
        assert isinstance(caught, RankZeroFailed), repr(caught)
        assert "ValueError: rank 0's block fails on purpose" in str(caught) and not ran, (str(caught), ran)
    assert close(after, [float(world)]), after


def _model() -> nn.Module:
    torch.manual_seed(1234 + 0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _data(world: int, batch: int, steps: int) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(steps * world * batch, 4, generator=g),
                         torch.randn(steps * world * batch, 1, generator=g))


def train(fabric: Any, steps: int = 4, batch: int = 3, accumulate: int = 1) -> Any:
    """SGD with momentum through fabric.setup / setup_dataloaders / backward / step; returns the set-up model and
    optimizer.
    With ``accumulate`` > 1, each step is that many micro-batches, all but the last under no_backward_sync."""
    world = fabric.world_size
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(_data(world, batch, steps * accumulate), batch_size=batch))
    for i, (x, y) in enumerate(loader):
        last = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = nn.functional.mse_loss(model(x), y) / accumulate
            fabric.backward(loss)
        if last:
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizer


def reference(world: int, steps: int = 4, batch: int = 3, accumulate: int = 1) -> nn.Module:
    """One process on the union of every rank's batches: what data-parallel training must reproduce."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = _data(world, batch, steps * accumulate)
    for x, y in DataLoader(data, batch_size=world * batch * accumulate):
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _params(model: nn.Module) -> List[torch.Tensor]:
    return [p.detach().cpu().clone() for p in model.parameters()]


@check
def training_parity(fabric: Any, out: str) -> None:
    params = _params(train(fabric)[0])
    expected = _params(reference(fabric.world_size))
    if fabric.is_global_zero:
        torch.save(params, os.path.join(out, f"params-{fabric.strategy.name}.pt"))
    for got, exp in zip(params, expected):
        assert torch.allclose(got, exp, atol=1e-5), (got, exp)


@check
def accumulation_parity(fabric: Any, out: str) -> None:
    params = _params(train(fabric, steps=2, accumulate=3)[0])
    expected = _params(reference(fabric.world_size, steps=2, accumulate=3))
    for got, exp in zip(params, expected):
        assert torch.allclose(got, exp, atol=1e-5), (got, exp)


@check
def save_load(fabric: Any, out: str) -> None:
    model, optimizer = train(fabric, steps=2)
    path = os.path.join(out, "ckpt.pt")
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 7, "note": "x"})
    fresh = fabric.setup(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.1)
    rest = fabric.load(path, {"model": fresh, "optimizer": fresh_opt})
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert rest == {"step": 7, "note": "x"}, rest
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(fresh)))
    assert fresh_opt.param_groups[0]["lr"] == 0.1 and fresh_opt.param_groups[0]["momentum"] == 0.9
    assert len(fresh_opt.state) == len(list(fresh.parameters())), "momentum buffers restored"
    assert all(t.device.type == "cpu" for t in raw["model"].values()), "checkpoint tensors must be saved on the CPU"


#: the backend-independent checks, in the order a lane runs them
ALL = list(CHECKS)
