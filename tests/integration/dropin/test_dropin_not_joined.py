"""Before the job is joined (script mode without launch(), or under torchrun / srun / mpirun without launch()),
every set-up call, collective, save and load raises fabriclite's RuntimeError naming `fabric.launch()` and
`fabriclite run`, and nothing reaches torch.distributed. One process, no ranks started."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, Tuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from fabriclite import Fabric

#: an external launcher's variables for rank 1 of 2 (nothing listens at the port: joining would fail loudly)
LAUNCHERS: Dict[str, Dict[str, str]] = {
    "torchrun": {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"},
    "srun": {"SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2",
             "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_ID": "123", "SLURM_NODELIST": "localhost",
             "SLURM_JOB_NAME": "train.py", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
    "mpirun": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
               "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": "1"},
}


def _calls(tmp_path: Any) -> Dict[str, Callable[[Fabric], Any]]:
    model = nn.Linear(2, 2)
    loader = DataLoader(list(range(4)), batch_size=2)
    return {
        "setup": lambda f: f.setup(model, torch.optim.SGD(model.parameters(), lr=0.1)),
        "setup_module": lambda f: f.setup_module(model),
        "setup_optimizers": lambda f: f.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1)),
        "setup_dataloaders": lambda f: f.setup_dataloaders(loader),
        "init_module": lambda f: f.init_module(),
        "barrier": lambda f: f.barrier(),
        "broadcast": lambda f: f.broadcast(torch.ones(1)),
        "all_gather": lambda f: f.all_gather(torch.ones(1)),
        "all_reduce": lambda f: f.all_reduce(torch.ones(1)),
        "gather": lambda f: f.gather(torch.ones(1)),
        "reduce": lambda f: f.reduce(torch.ones(1)),
        "rank_zero_first": lambda f: f.rank_zero_first().__enter__(),
        "gather_eval": lambda f: f.gather_eval(torch.ones(1), loader),
        "save": lambda f: f.save(tmp_path / "new.ckpt", {"w": torch.zeros(3)}),
        "load": lambda f: f.load(tmp_path / "c.ckpt"),
        "load_raw": lambda f: f.load_raw(tmp_path / "c.ckpt", model),
        "load_latest": lambda f: f.load_latest(tmp_path),
        "check_preempted": lambda f: f.check_preempted(),
    }


def _tree(root: Path) -> Dict[str, Tuple[int, int, int]]:
    """Every file and folder under ``root`` (hidden temporaries too): (inode, size, mtime_ns) by relative path."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            out[os.path.relpath(path, root)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("where", ["script", *LAUNCHERS])
def test_every_call_before_joining_raises(tmp_path, no_launch_env, where):
    for name, value in LAUNCHERS.get(where, {}).items():
        no_launch_env.setenv(name, value)
    fabric = Fabric(accelerator="cpu", devices=2)
    expected_env = {"script": "Local", "torchrun": "TorchElastic", "srun": "SLURM", "mpirun": "MPI"}[where]
    assert expected_env.lower() in type(fabric.strategy.cluster_environment).__name__.lower()
    torch.save({"w": torch.ones(1)}, tmp_path / "c.ckpt")
    before = _tree(tmp_path)
    for name, call in _calls(tmp_path).items():
        with pytest.raises(RuntimeError) as info:
            call(fabric)
        message = str(info.value)
        assert f"fabric.{name}()" in message and "fabric.launch()" in message and "fabriclite run" in message, message
    assert not dist.is_initialized()  # nothing reached torch.distributed
    assert _tree(tmp_path) == before, "a call before launch() changed the checkpoint folder"  # save wrote nothing


def test_lightning_raises_on_the_same_set_up_calls(tmp_path, no_launch_env):
    """The reference: Lightning Fabric refuses these calls before launch() too (its own RuntimeError)."""
    from lightning.fabric import Fabric as LightningFabric

    fabric = LightningFabric(accelerator="cpu", devices=2)
    calls = _calls(tmp_path)
    for name in ("setup", "setup_module", "setup_optimizers", "setup_dataloaders", "init_module", "barrier",
                 "broadcast", "all_gather", "all_reduce"):
        with pytest.raises(RuntimeError, match="launch"):
            calls[name](fabric)
    assert not dist.is_initialized()


def test_single_device_needs_no_launch(tmp_path, no_launch_env):
    """Lightning's rule: the single-device strategy works without launch()."""
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup_module(nn.Linear(2, 2))
    assert torch.equal(fabric.all_reduce(torch.tensor([2.0])), torch.tensor([2.0]))
    fabric.barrier()
    fabric.save(tmp_path / "s.ckpt", {"model": model})
    restored = fabric.load(tmp_path / "s.ckpt")
    assert restored.keys() == {"model"}
    assert all(torch.equal(restored["model"][k], v) for k, v in model.state_dict().items())
    assert not dist.is_initialized()
