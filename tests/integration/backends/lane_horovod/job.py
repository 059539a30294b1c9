"""A fabriclite script for the Horovod lane, started by test_lane_horovod.py:

    horovodrun -np 2 -H localhost:2 --gloo python job.py checks OUT   every check of checks.py on HorovodStrategy
    python job.py ddp OUT                                             training parity on fabriclite's DDP (2 ranks)
    horovodrun -np 3 -H localhost:3 --gloo python job.py groups OUT   process sets as group=
    horovodrun -np 2 -H localhost:2 --gloo python job.py fail OUT     rank 1 raises after launch
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import checks  # noqa: E402
from fabriclite import Fabric  # noqa: E402
from fabriclite.strategies import HorovodStrategy  # noqa: E402


@checks.check
def horovod_internals(fabric: Fabric, out: str) -> None:
    import horovod.torch as hvd

    model, optimizer = checks.train(fabric, steps=1)
    inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
    assert fabric.world_size == hvd.size() and fabric.global_rank == hvd.rank(), (fabric.world_size, hvd.size())
    assert fabric.local_rank == hvd.local_rank() and fabric.node_rank == hvd.cross_rank()
    assert type(inner).__module__ == "horovod.torch.optimizer", type(inner)
    names = set(inner._parameter_names.values())
    assert names == {name for name, _ in model.module.named_parameters()}, names


@checks.check
def process_set_groups(fabric: Fabric, out: str) -> None:
    strategy, rank = fabric.strategy, fabric.global_rank
    got = {}
    if rank in (0, 2):
        group = strategy.resolve_group([0, 2])
        got["sum"] = strategy.flat_all_reduce(torch.tensor([rank + 1.0]), "sum", group)
        got["bxor"] = strategy.flat_all_reduce(torch.tensor([rank + 1]), "bxor", group)
        got["gather"] = strategy.flat_all_gather(torch.tensor([rank]), group)
        got["bcast"] = strategy.flat_broadcast(torch.tensor([rank, 5]), 2, group)
        got["objects"] = strategy.all_gather_object({"r": rank}, group)
        got["bobj"] = strategy.broadcast_object("from two" if rank == 2 else None, 2, group)
        got["nested"] = fabric.all_reduce({"a": torch.tensor([rank + 1.0]), "b": [rank]}, group=[0, 2], reduce_op="sum")
        strategy.barrier(None, group)
        assert strategy.group_size(group) == 2 and strategy.group_ranks(group) == [0, 2]
    try:
        strategy.resolve_group([0, 1])
        error = ""
    except ValueError as err:
        error = str(err)
    fabric.barrier()
    assert "process_sets=[[0, 1]]" in error, error
    if rank in (0, 2):
        assert got["sum"].tolist() == [4.0] and got["bxor"].tolist() == [2], got
        assert got["gather"].tolist() == [[0], [2]] and got["bcast"].tolist() == [2, 5], got
        assert got["objects"] == [{"r": 0}, {"r": 2}] and got["bobj"] == "from two", got
        assert got["nested"]["a"].tolist() == [4.0] and int(got["nested"]["b"][0]) == 2, got


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode == "checks":
        fabric = Fabric(strategy="horovod", accelerator="cpu")
        fabric.launch()
        checks.run(fabric, [*checks.ALL, "horovod_internals"], out)
    elif mode == "ddp":
        fabric = Fabric(strategy="ddp", accelerator="cpu", devices=2)
        fabric.launch()
        checks.run(fabric, ["training_parity"], os.path.join(out, "ddp"))
    elif mode == "groups":
        fabric = Fabric(strategy=HorovodStrategy(process_sets=[[0, 2]]), accelerator="cpu")
        fabric.launch()
        checks.run(fabric, ["process_set_groups", "all_reduce_nested", "all_gather_uneven_cat"], out)
    elif mode == "fail":
        fabric = Fabric(strategy="horovod", accelerator="cpu")
        fabric.launch()
        if fabric.global_rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        fabric.barrier()  # rank 0 waits for a peer that is gone: horovodrun must end it
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
