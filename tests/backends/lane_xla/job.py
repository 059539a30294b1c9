"""A fabriclite script for the XLA lane (torch 2.9.1 + torch_xla 2.9.0, ``PJRT_DEVICE=CPU``), started by
test_lane_xla.py in a fresh process per mode (the XLA runtime's device count is fixed at its start):

    python job.py single OUT    Fabric(accelerator="tpu", devices=1): the single-device XLA strategy, in-process
    python job.py spawn OUT     Fabric(accelerator="tpu", devices=1, strategy="xla"): XLAStrategy via the XLA launcher
    CPU_NUM_DEVICES=2 python job.py threads OUT   two XLA devices driven by one process (a thread each)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import checks  # noqa: E402
from fabriclite import Fabric  # noqa: E402

#: what one process driving several XLA devices supports (see docs/backends.md): fabriclite's collectives, each a
#: graph holding one all-reduce. Training is not among them: a step's graph holds backward and the gradient
#: all-reduce together, which XLA's CPU client cannot keep in step across threads (it aborts after 10 s).
THREADED = ["rank_properties", "all_reduce_nested", "all_reduce_bitwise", "all_gather_nested",
            "all_gather_uneven_cat", "broadcast_and_objects", "gather_reduce_barrier", "rank_zero_first_order",
            "rank_zero_first_failure"]


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


def _run_all(fabric: Fabric, out: str, names: list) -> dict:
    return checks.run(fabric, names, out)


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    names = [*checks.ALL, "xla_placement"]
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
        fabric = Fabric(accelerator="tpu", devices=2)
        assert type(fabric.strategy).__name__ == "XLAStrategy" and fabric.world_size == 2, fabric.strategy
        result = fabric.launch(_run_all, out, THREADED)
        assert set(result) == set(THREADED), result
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
