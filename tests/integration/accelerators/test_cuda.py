"""CUDA and NCCL paths, on a real GPU (skipped cleanly where there is none: CI never has one).

One GPU is enough: NCCL refuses two ranks on one device, so the NCCL world here has one rank, which
still runs the process group, the header agreement and every bucketed collective through NCCL.
"""
from __future__ import annotations

import pytest
import torch

from fabriclite import Fabric
from helpers import json_lines, python, write_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NCCL_JOB = """
    import json, sys
    import torch
    from torch import nn
    from fabriclite import Fabric

    fabric = Fabric(accelerator="cuda", devices=1, strategy="ddp", precision="{precision}")
    fabric.launch()
    import torch.distributed as dist
    facts = dict(backend=dist.get_backend(), device=str(fabric.device), world=fabric.world_size)
    data = {{"loss": torch.tensor(2.5, device="cuda"), "n": 3, "acc": [torch.arange(4, device="cuda"), 1.5],
             "name": "gpu"}}
    red = fabric.all_reduce(data, reduce_op="sum")
    facts["reduce"] = [red["loss"].item(), red["n"].item(), red["acc"][0].tolist(), red["acc"][1].item(),
                       red["name"], red["loss"].device.type]
    gat = fabric.all_gather({{"x": torch.ones(3, 2, device="cuda")}}, cat=True)
    facts["gather"] = [list(gat["x"].shape), gat["x"].device.type]
    facts["broadcast"] = fabric.broadcast({{"t": torch.full((2,), 7.0, device="cuda"), "s": "hi"}})["t"].device.type
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    losses = []
    for _ in range(3):
        x = torch.randn(32, 8, device=fabric.device)
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
        losses.append(loss.item())
    facts["losses"] = losses
    facts["param_dtype"] = str(next(model.parameters()).dtype)
    facts["scaler"] = getattr(fabric._precision, "scaler", None) is not None
    sys.stdout.write("FACTS " + json.dumps(facts) + "\\n")
"""


@pytest.mark.parametrize("precision", ["32-true", "16-mixed", "bf16-mixed", "bf16-true"])
def test_nccl_job_collectives_and_training(tmp_path, precision):
    result = python(write_script(tmp_path, NCCL_JOB.format(precision=precision)), timeout=120)
    assert result.returncode == 0, result.stderr
    (facts,) = json_lines(result.stdout)
    assert facts["backend"] == "nccl" and facts["device"] == "cuda:0" and facts["world"] == 1
    assert facts["reduce"] == [2.5, 3, [0, 1, 2, 3], 1.5, "gpu", "cuda"]
    assert facts["gather"] == [[3, 2], "cuda"] and facts["broadcast"] == "cuda"
    assert all(torch.isfinite(torch.tensor(facts["losses"])))
    assert facts["scaler"] == (precision == "16-mixed")
    assert facts["param_dtype"] == ("torch.bfloat16" if precision == "bf16-true" else "torch.float32")


def test_cuda_devices_parsing_and_auto():
    count = torch.cuda.device_count()
    assert Fabric(accelerator="cuda", devices=-1).world_size == count
    assert Fabric(accelerator="gpu", devices="0,").device == torch.device("cuda", 0)  # Lightning: "0," is index 0
    assert Fabric(accelerator="cuda", devices=[0]).device == torch.device("cuda", 0)
    assert Fabric().accelerator.name == "cuda"  # "auto" picks the GPU
    with pytest.raises(ValueError, match=f"index {count} is out of range"):
        Fabric(accelerator="cuda", devices=[count])
    with pytest.raises(ValueError, match=f"asks for {count + 1} cuda devices but {count} are available"):
        Fabric(accelerator="cuda", devices=count + 1)


# ---------------------------------------------------------------------- fsdp on one GPU (NCCL, one rank)
FSDP_JOB = """
    import json, os, sys
    import torch
    from torch import nn
    from fabriclite import Fabric
    from fabriclite.strategies import FSDPStrategy

    path, precision, offload = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    fabric = Fabric(accelerator="cuda", devices=1, precision=precision,
                    strategy=FSDPStrategy(cpu_offload=offload, auto_wrap_policy={{nn.Linear}}))
    fabric.launch()
    import torch.distributed as dist

    def make(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 6))
        return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    def steps(model, opt, n):
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(n):
            x = torch.randn(16, 12, generator=g).to(fabric.device)
            loss = model(x).float().pow(2).mean()
            opt.zero_grad()
            fabric.backward(loss)
            fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            losses.append(loss.item())
        return losses

    model, opt = make(0)
    first = steps(model, opt, 3)
    fabric.save(path, {{"model": model, "optimizer": opt, "step": 3}})
    after = steps(model, opt, 2)
    resumed, ropt = make(5)
    state = {{"model": resumed, "optimizer": ropt, "step": 0}}
    fabric.load(path, state)
    again = steps(resumed, ropt, 2)
    param = next(model.parameters())
    facts = dict(backend=dist.get_backend(), files=sorted(os.listdir(path)), step=state["step"],
                 finite=all(map(lambda v: v == v, first)), resumed_equal=after == again,
                 param_device=str(param.to_local().device))
    sys.stdout.write("FACTS " + json.dumps(facts) + "\\n")
"""


@pytest.mark.parametrize("precision, offload", [("32-true", False), ("bf16-mixed", False), ("32-true", True)])
def test_fsdp_on_one_gpu_trains_saves_and_resumes(tmp_path, precision, offload):
    script = write_script(tmp_path, FSDP_JOB.format())
    result = python(script, str(tmp_path / "ckpt"), precision, "1" if offload else "0", timeout=180)
    assert result.returncode == 0, result.stderr
    (facts,) = json_lines(result.stdout)
    assert facts["backend"] == "nccl" and facts["step"] == 3 and facts["finite"]
    assert facts["files"] == [".metadata", "__0_0.distcp", "meta.pt"]
    assert facts["resumed_equal"]  # the sharded checkpoint restores weights and optimizer state exactly
    assert facts["param_device"] == ("cpu" if offload else "cuda:0")  # offloaded shards live on the CPU
