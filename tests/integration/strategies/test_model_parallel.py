"""ModelParallelStrategy on real ranks (tensor parallel at tp=2 against one process, loss_parallel, data sharded
over the data-parallel dim only), and interoperability with Lightning's ModelParallelStrategy (dp=2, fully_shard
on the same submodules): the sharded checkpoints each side writes hold identical weights and optimizer state,
read whole by torch.distributed.checkpoint on every rank, and each side loads the other's and continues alike."""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from fabriclite import Fabric
from fabriclite.strategies import ModelParallelStrategy
from test_fsdp import Block, build, fsdp_fabric, train


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 24)
        self.fc2 = nn.Linear(24, 12)
        self.head = nn.Linear(12, 6)

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def tensor_parallel(model, mesh):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}  # logits stay sharded
    return parallelize_module(model, mesh["tensor_parallel"], plan)


def shard_blocks(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for block in [m for m in model.modules() if isinstance(m, Block)]:
        fully_shard(block, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def _mp_fabric(world, **kwargs):
    fabric = Fabric(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(**kwargs))
    fabric.launch()
    return fabric


def _tp_losses(fabric, model, opt, parallel: bool):
    """Per step: the loss and the gradient norm."""
    from torch.distributed.tensor.parallel import loss_parallel

    g = torch.Generator().manual_seed(7)  # the same batches on every rank of the tensor-parallel group
    losses = []
    for _ in range(5):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 6, (8,), generator=g)
        opt.zero_grad()
        if parallel:
            with loss_parallel():
                loss = nn.functional.cross_entropy(model(x), y)
                fabric.backward(loss)
            losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
            losses.append(float(fabric.clip_gradients(model, opt, max_norm=1e9)))  # the norm over every shard
        else:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            losses.append(loss.item())
            losses.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
    return losses


def _tensor_parallel(fabric):
    out = {}
    torch.manual_seed(0)
    reference = MLP()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    out["reference"] = _tp_losses(None, reference, ref_opt, parallel=False)

    tp = _mp_fabric(fabric.world_size, parallelize_fn=tensor_parallel, data_parallel_size=1, tensor_parallel_size=2)
    with tp.init_module(empty_init=True):
        model = MLP()
    model = tp.setup_module(model)
    torch.manual_seed(0)
    full = MLP().state_dict()
    tp.strategy.load_module_state_dict(model._forward_module, full)  # the reference's start, onto the shards
    opt = tp.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out["tp"] = _tp_losses(tp, model, opt, parallel=True)
    out["local_shape"] = tuple(model.fc1.weight.to_local().shape)
    loader = tp.setup_dataloaders(DataLoader(list(range(8)), batch_size=2, shuffle=True))
    out["batches"] = [b.tolist() for b in loader]
    out["sampler"] = tp.strategy.distributed_sampler_kwargs
    return out


def test_tensor_parallel_mlp_matches_one_process(pool2):
    results = pool2.run(_tensor_parallel)
    for r in results:
        assert r["local_shape"] == (12, 6)  # fc1 split column-wise over 2 ranks
        assert torch.allclose(torch.tensor(r["tp"]), torch.tensor(r["reference"]), rtol=1e-6), r
        assert r["sampler"] == {"num_replicas": 1, "rank": 0}
    assert results[0]["batches"] == results[1]["batches"]  # a tensor-parallel group sees the same batches


@contextmanager
def _torchrun_env(fabric):
    """This rank as torchrun would describe it, so that Lightning joins the existing process group."""
    env = {"RANK": str(fabric.global_rank), "WORLD_SIZE": str(fabric.world_size), "LOCAL_RANK": str(fabric.local_rank),
           "LOCAL_WORLD_SIZE": str(fabric.world_size), "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": "pool"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def dcp_tensors(path):
    """Every tensor of the sharded checkpoint directory ``path``, read whole on this rank alone by
    torch.distributed.checkpoint (no process group, neither side's loader), by its key in the file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in metadata.items()
             if isinstance(meta, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _same_files(root, names):
    """(keys of the first file, [key differences]): the files' tensors, compared with the first file's."""
    files = {name: dcp_tensors(os.path.join(root, name)) for name in names}
    first = files[names[0]]
    diffs = []
    for name in names[1:]:
        other = files[name]
        if set(other) != set(first):
            diffs.append(f"{name} keys {sorted(set(other) ^ set(first))} differ from {names[0]}'s")
        diffs += [f"{name}: {key}" for key in sorted(set(first) & set(other)) if not torch.equal(first[key], other[key])]
    return sorted(first), diffs


def _lightning_interop(fabric, root):
    with _torchrun_env(fabric):  # Lightning reads its ranks from the environment whenever it needs them
        return _interop(fabric, root)


def _interop(fabric, root):
    import lightning.fabric as lf
    from lightning.fabric.strategies import ModelParallelStrategy as LightningModelParallel

    out = {}
    lightning = lf.Fabric(accelerator="cpu", devices=fabric.world_size,
                          strategy=LightningModelParallel(shard_blocks, data_parallel_size=2, tensor_parallel_size=1))
    lightning.launch()
    lmodel = lightning.setup_module(build())
    lopt = lightning.setup_optimizers(torch.optim.AdamW(lmodel.parameters(), lr=1e-2))
    out["lightning_losses"] = train(lightning, lmodel, lopt, steps=4, clip=False)[0]
    lightning.save(os.path.join(root, "lightning.ckpt"), {"model": lmodel, "optimizer": lopt, "step": 4})

    fsdp = fsdp_fabric(fabric.world_size, auto_wrap_policy={Block})
    model = fsdp.setup_module(build())
    opt = fsdp.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    out["fsdp_losses"] = train(fsdp, model, opt, steps=4, clip=False)[0]
    fsdp.save(os.path.join(root, "fabriclite.ckpt"), {"model": model, "optimizer": opt, "step": 4})

    mp = _mp_fabric(fabric.world_size, parallelize_fn=shard_blocks, data_parallel_size=2, tensor_parallel_size=1)
    mmodel = mp.setup_module(build())
    mopt = mp.setup_optimizers(torch.optim.AdamW(mmodel.parameters(), lr=1e-2))
    train(mp, mmodel, mopt, steps=4, clip=False)
    mp.save(os.path.join(root, "model_parallel.ckpt"), {"model": mmodel, "optimizer": mopt, "step": 4})
    # the three files, written by each side after the same 4 steps, read whole on every rank
    out["keys"], out["diffs"] = _same_files(root, ["lightning.ckpt", "fabriclite.ckpt", "model_parallel.ckpt"])

    # each side loads the other's checkpoint and continues
    state = {"model": model, "optimizer": opt, "step": 0}
    fsdp.load(os.path.join(root, "lightning.ckpt"), state)
    out["fsdp_from_lightning"] = state["step"], train(fsdp, model, opt, steps=3, clip=False)[0]
    state = {"model": lmodel, "optimizer": lopt, "step": 0}
    lightning.load(os.path.join(root, "fabriclite.ckpt"), state)
    out["lightning_from_fsdp"] = state["step"], train(lightning, lmodel, lopt, steps=3, clip=False)[0]
    # Lightning's full file (save_distributed_checkpoint=False) into fsdp: weights and optimizer state
    lightning.strategy._save_distributed_checkpoint = False
    full = os.path.join(root, "lightning_full.ckpt")
    lightning.save(full, {"model": lmodel, "optimizer": lopt, "step": 7})
    fresh = fsdp.setup_module(build(seed=9))
    fresh_opt = fsdp.setup_optimizers(torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    fsdp.load(full, state)
    out["full_step"] = state["step"]
    out["full_next"] = train(fsdp, fresh, fresh_opt, steps=2, clip=False)[0], \
        train(lightning, lmodel, lopt, steps=2, clip=False)[0]
    out["files"] = sorted(os.listdir(os.path.join(root, "lightning.ckpt"))), \
        sorted(os.listdir(os.path.join(root, "fabriclite.ckpt")))
    return out


def test_lightning_model_parallel_interop(pool2, tmp_path):
    results = pool2.run(_lightning_interop, str(tmp_path))
    assert len(results) == 2
    for r in results:
        assert r["fsdp_losses"] == r["lightning_losses"]
        assert not r["diffs"], r["diffs"]  # every tensor of every file, on every rank
        assert any(k.startswith("model.") for k in r["keys"]) and any("exp_avg" in k for k in r["keys"]), r["keys"]
        assert r["files"][0] == r["files"][1] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
        # both restored step 4 of the same run, so they continue identically
        assert r["fsdp_from_lightning"][0] == r["lightning_from_fsdp"][0] == 4
        assert r["fsdp_from_lightning"][1] == r["lightning_from_fsdp"][1]
        assert r["full_step"] == 7 and r["full_next"][0] == r["full_next"][1]  # same weights and AdamW state


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(parallelize_fn=42), TypeError, "parallelize_fn=42 is not callable"),
    (dict(parallelize_fn=shard_blocks, data_parallel_size=0), ValueError, "data_parallel_size=0"),
    (dict(parallelize_fn=shard_blocks, tensor_parallel_size="two"), ValueError, "tensor_parallel_size='two'"),
])
def test_bad_model_parallel_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ModelParallelStrategy(**kwargs)


def test_sizes_must_multiply_to_the_world_size():
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 = 4.*world size is 2"):
        Fabric(accelerator="cpu", devices=2,
               strategy=ModelParallelStrategy(shard_blocks, data_parallel_size=2, tensor_parallel_size=2))
