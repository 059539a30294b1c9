"""A fabriclite script for the XLA lane (torch 2.9.1 + torch_xla 2.9.0, ``PJRT_DEVICE=CPU``), started by
test_lane_xla.py in a fresh process per mode (the XLA runtime's device count is fixed at its start):

    python job.py single OUT    Fabric(accelerator="tpu", devices=1): the single-device XLA strategy, in-process
    python job.py spawn OUT     Fabric(accelerator="tpu", devices=1, strategy="xla"): XLAStrategy via the XLA launcher
    CPU_NUM_DEVICES=2 python job.py threads OUT   two XLA devices driven by one process (a thread each): no training
                                                  (see THREADED for what runs, and why)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import checks  # noqa: E402
from fabriclite import Fabric  # noqa: E402

#: what runs with two XLA devices here (CPU_NUM_DEVICES=2; measured with torch_xla 2.9.0, see docs/backends.md).
#: On PJRT_DEVICE=CPU, xmp.spawn always starts ONE process (torch_xla/_internal/pjrt.py: run_multiprocess uses one
#: process for device types other than TPU and Neuron) and drives the devices from a thread each; the CPU client
#: keeps the threads' collectives in step only when a graph holds a single collective. A graph with two (the gradient
#: all-reduce of a training step under xm.optimizer_step, or xm.broadcast_master_param of a model's parameters in
#: setup) aborts the process after 10 s ("Termination timeout for `all reduce RendezvousKey{...}` ... Expected 2
#: threads to join the rendezvous, but only 1 of them arrived on time"). So training_parity, accumulation_parity and
#: save_load run at world size 1 only; at world size 2 run every collective (one graph each), rank_zero_first over
#: the no-store path, the data loader's sharding and a checkpoint's save/load without training, with
#: XLAStrategy(sync_module_states=False) (setup's broadcast is the two-collective graph above).
THREADED = ["rank_properties", "all_reduce_nested", "all_reduce_bitwise", "all_reduce_inplace",
            "all_gather_nested", "all_gather_uneven_cat", "broadcast_and_objects", "gather_reduce_barrier", "rank_zero_first_order",
            "rank_zero_first_failure", "lightning_strategy_all_reduce", "xla_setup_and_checkpoint_without_training",
            "xla_dataloader_shards"]


@checks.check
def xla_placement(fabric: Fabric, out: str) -> None:
    import torch_xla.core.xla_model as xm
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    assert fabric.device.type == "xla" and type(fabric.accelerator).__name__ == "XLAAccelerator"
    model = fabric.setup(torch.nn.Linear(2, 2))
    assert next(model.parameters()).device.type == "xla"
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(8.0).view(4, 2)), batch_size=2))
    inner = getattr(loader, "_loader", None) or getattr(loader, "loader", None) or loader
    seen = [batch[0] for batch in loader]
    assert all(b.device.type == "xla" for b in seen), [b.device for b in seen]
    assert isinstance(inner, MpDeviceLoader) or any(isinstance(v, MpDeviceLoader) for v in vars(loader).values())
    assert torch.equal(torch.cat([b.cpu() for b in seen]), torch.arange(8.0).view(4, 2))
    assert xm.xla_device_hw(fabric.device) == "CPU"


def _linear(seed: int) -> torch.nn.Linear:
    """A Linear(3, 2) whose parameters come from its own generator: in the two-device mode the ranks are threads of
    one process, so torch's global RNG is shared and ``torch.manual_seed`` on one rank would race the other's
    initialisation (CI once saw rank 0's bias drawn after rank 1 reseeded)."""
    gen = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return layer


@checks.check
def xla_setup_and_checkpoint_without_training(fabric: Fabric, out: str) -> None:
    """Checkpoints without training: each rank builds its model from its own seed; ``setup`` gives every rank global
    rank 0's parameters (unless ``sync_module_states=False``: the two-device mode, see THREADED), ``save`` writes
    rank 0's once, and ``load`` restores them into a fresh model on every rank (the reference: rank 0's model built
    in plain torch)."""
    rank, world = fabric.global_rank, fabric.world_size
    synced = world == 1 or fabric.strategy.sync_module_states
    model = fabric.setup(_linear(100 + rank))
    own = [p.detach().clone() for p in _linear(100 if synced else 100 + rank).parameters()]  # what setup must leave
    reference = [p.detach().clone() for p in _linear(100).parameters()]  # rank 0's, in plain torch
    got = [p.detach().cpu() for p in model.parameters()]
    path = os.path.join(out, f"xla-ckpt-world{world}.pt")
    fabric.save(path, {"model": model, "step": 3})
    fresh = fabric.setup(_linear(200 + rank))
    rest = fabric.load(path, {"model": fresh})
    loaded = [p.detach().cpu() for p in fresh.parameters()]
    raw = torch.load(path, map_location="cpu", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(got, own)), (got, own)
    assert all(torch.equal(a, b) for a, b in zip(loaded, reference)), (loaded, reference)
    assert rest == {"step": 3} and sorted(raw["model"]) == ["bias", "weight"], (rest, list(raw["model"]))
    assert torch.equal(raw["model"]["weight"], reference[0]), raw["model"]


@checks.check
def xla_dataloader_shards(fabric: Fabric, out: str) -> None:
    """``setup_dataloaders`` gives each rank its own part of the data (an MpDeviceLoader on the rank's device); the
    ranks' parts, gathered, are the whole dataset once."""
    data = torch.arange(32.0).view(16, 2)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(data), batch_size=2))
    seen = torch.cat([batch[0] for batch in loader])
    devices = {seen.device.type}
    everyone = fabric.all_gather(seen.cpu()).reshape(-1, 2).cpu()
    assert devices == {"xla"} and seen.shape == (16 // fabric.world_size, 2), (devices, seen.shape)
    assert sorted(everyone[:, 0].tolist()) == data[:, 0].tolist(), everyone


@checks.check
def lightning_strategy_all_reduce(fabric: Fabric, out: str) -> None:
    """``strategy.all_reduce(output, group=None, reduce_op=None)``: Lightning's XLA signature, None summing."""
    base = torch.tensor([1.0, 2.0])
    mine = (base * (fabric.global_rank + 1)).to(fabric.device)
    total = sum(base * (r + 1) for r in range(fabric.world_size))
    if type(fabric.strategy).__name__ == "XLAStrategy":
        assert torch.equal(fabric.strategy.all_reduce(output=mine).cpu(), total)  # Lightning's default: sum
        assert torch.equal(fabric.strategy.all_reduce(mine, reduce_op="mean").cpu(), total / fabric.world_size)
    else:  # one device: Lightning's single-device all_reduce returns its input
        assert torch.equal(fabric.strategy.all_reduce(mine).cpu(), base)


#: this lane's own checks (after checks.ALL in the one-device modes)
XLA_CHECKS = ["xla_placement", "lightning_strategy_all_reduce", "xla_setup_and_checkpoint_without_training",
              "xla_dataloader_shards"]


def _run_all(fabric: Fabric, out: str, names: list) -> dict:
    return checks.run(fabric, names, out)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    names = [*checks.ALL, *XLA_CHECKS]
    if mode == "single":
        fabric = Fabric(accelerator="tpu", devices=1)
        assert type(fabric.strategy).__name__ == "SingleDeviceXLAStrategy", fabric.strategy
        fabric.launch()
        checks.run(fabric, names, out)
    elif mode == "spawn":
        fabric = Fabric(accelerator="tpu", devices=1, strategy="xla")
        assert type(fabric.strategy).__name__ == "XLAStrategy", fabric.strategy
        result = fabric.launch(_run_all, out, names)
        assert set(result) == set(names), result  # rank 0's return value comes back to the caller
    elif mode == "threads":
        from fabriclite.strategies import XLAStrategy

        fabric = Fabric(accelerator="tpu", devices=2, strategy=XLAStrategy(sync_module_states=False))
        assert type(fabric.strategy).__name__ == "XLAStrategy" and fabric.world_size == 2, fabric.strategy
        result = fabric.launch(_run_all, out, THREADED)
        assert set(result) == set(THREADED), result
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
