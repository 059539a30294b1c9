"""Fabric(...) arguments: resolution and every validation error (type and message), before anything starts."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from fabriclite import Fabric
from fabriclite.accelerators import CPUAccelerator
from fabriclite.environments import SLURMEnvironment
from fabriclite.precision import MixedPrecision, Precision
from fabriclite.strategies import DDPStrategy, SingleDeviceStrategy
from helpers import CLUSTER_VARS


@pytest.fixture(autouse=True)
def no_cluster(monkeypatch):
    import os

    for key in list(os.environ):
        if CLUSTER_VARS.match(key):
            monkeypatch.delenv(key)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(devices=0), ValueError, r"devices=0 must be a positive"),
        (dict(devices=-2), ValueError, r"devices=-2 must be a positive"),
        (dict(devices="abc"), ValueError, r"devices='abc' is not a number.*devices=\"auto\""),
        (dict(devices=1.5), TypeError, r"devices=1\.5 \(float\) is not valid"),
        (dict(devices=True), TypeError, r"devices=True \(bool\)"),
        (dict(devices=[0, 1]), ValueError, r"devices=\[0, 1\]: a list of device indices is for accelerator='cuda'"),
        (dict(devices="0,1"), ValueError, r"devices='0,1': a comma-separated list .* accelerator='cuda'"),
        (dict(devices=-1), ValueError, r"devices=-1 means 'all GPUs'"),
        (dict(num_nodes=0), ValueError, r"num_nodes=0 must be an int >= 1"),
        (dict(num_nodes=1.0), TypeError, r"num_nodes=1\.0 \(float\)"),
        (dict(accelerator="quantum"), ValueError, r"accelerator='quantum' is not supported.*'cpu'.*'cuda'"),
        (dict(accelerator=3), TypeError, r"accelerator=3 \(int\) is not valid"),
        (dict(strategy="fsdp9"), ValueError, r"strategy='fsdp9' is not supported.*'ddp'.*'horovod'"),
        (dict(strategy=object()), TypeError, r"strategy=<object.*is not valid"),
        (dict(precision="8-true"), ValueError, r"precision='8-true' is not supported.*\"bf16-mixed\""),
        (dict(plugins=["nope"]), TypeError, r"plugins: 'nope' \(str\) is not supported"),
        (dict(devices=2, strategy="single_device"), ValueError, r"single_device' runs one process.*strategy='ddp'"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(kwargs, error, pattern):
    kwargs.setdefault("accelerator", "cpu")
    with pytest.raises(error, match=pattern):
        Fabric(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("name", ["cuda", "gpu"])
def test_cuda_without_gpu(name):
    with pytest.raises(ValueError, match=rf"accelerator='{name}' but no CUDA GPU is available.*accelerator='cpu'"):
        Fabric(accelerator=name)


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None, reason="torch_xla is installed")
def test_tpu_without_torch_xla_says_how_to_install():
    with pytest.raises(ValueError, match=r"accelerator='tpu' needs torch_xla.*pip install torch==2.9.1 torch-xla"):
        Fabric(accelerator="tpu")


@pytest.mark.skipif(importlib.util.find_spec("horovod") is not None, reason="horovod is installed")
def test_horovod_without_horovod_says_how_to_install():
    with pytest.raises(ValueError, match=r"strategy='horovod' needs the horovod package.*make env-horovod"):
        Fabric(accelerator="cpu", strategy="horovod")


def test_world_size_disagreeing_with_detected_cluster(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    for key, value in dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=4, GROUP_RANK=0, LOCAL_WORLD_SIZE=2,
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=29511).items():
        monkeypatch.setenv(key, str(value))
    with pytest.raises(ValueError, match=r"devices=3, num_nodes=2\) asks for 3 \* 2 = 6 processes.*world of 4"):
        Fabric(accelerator="cpu", devices=3)
    fabric = Fabric(accelerator="cpu")  # "auto" takes the environment's answer
    assert (fabric.world_size, fabric.num_nodes, fabric.strategy.num_processes) == (4, 2, 2)


def test_rank_properties_before_launch(monkeypatch):
    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=3)
    assert (fabric.world_size, fabric.global_rank, fabric.local_rank, fabric.node_rank) == (6, 0, 0, 0)
    assert fabric.num_nodes == 3 and fabric.is_global_zero and fabric.device == torch.device("cpu")
    assert isinstance(fabric.strategy, DDPStrategy) and isinstance(fabric.accelerator, CPUAccelerator)
    monkeypatch.setenv("NODE_RANK", "2")
    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=3)
    assert (fabric.global_rank, fabric.node_rank, fabric.is_global_zero) == (4, 2, False)


def test_node_rank_out_of_range(monkeypatch):
    monkeypatch.setenv("NODE_RANK", "3")
    with pytest.raises(ValueError, match=r"node rank 3 .* num_nodes=3; expected 0..2"):
        Fabric(accelerator="cpu", devices=2, num_nodes=3)


def test_auto_resolution_on_cpu():
    fabric = Fabric()
    assert fabric.world_size == 1 and isinstance(fabric.strategy, SingleDeviceStrategy)
    # "auto" is CUDA exactly when a GPU is visible (the reference: torch itself), and one device either way
    assert fabric.accelerator.name == ("cuda" if torch.cuda.is_available() else "cpu"), fabric.accelerator
    assert fabric.device.type == fabric.accelerator.name, fabric.device
    assert Fabric(accelerator="cpu", devices="3").world_size == 3


@pytest.mark.parametrize("name, start", [("ddp", "popen"), ("ddp_spawn", "spawn"), ("ddp_fork", "fork"),
                                         ("ddp_notebook", "fork"), ("ddp_find_unused_parameters_true", "popen")])
def test_ddp_flavours(name, start):
    strategy = Fabric(accelerator="cpu", devices=2, strategy=name).strategy
    assert isinstance(strategy, DDPStrategy) and strategy.start_method == start
    assert strategy.ddp_kwargs.get("find_unused_parameters", False) == name.endswith("true")


def test_strategy_instance_and_forced_environment(monkeypatch):
    # a SLURM interactive shell: not detected on its own, used when forced
    for key, value in dict(SLURM_NTASKS=2, SLURM_PROCID=1, SLURM_LOCALID=1, SLURM_NODEID=0, SLURM_NNODES=1,
                           SLURM_NODELIST="gpu[07-08]", SLURM_JOB_ID=4321, SLURM_JOB_NAME="bash",
                           SLURM_NTASKS_PER_NODE=2).items():
        monkeypatch.setenv(key, str(value))
    assert Fabric(accelerator="cpu", devices=2).strategy.cluster_environment.name == "local"
    strategy = DDPStrategy(start_method="spawn", static_graph=True)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[SLURMEnvironment()])
    assert fabric.strategy is strategy and strategy.ddp_kwargs == {"static_graph": True}
    assert isinstance(strategy.cluster_environment, SLURMEnvironment)
    assert (fabric.global_rank, fabric.local_rank, fabric.world_size) == (1, 1, 2)
    assert strategy.cluster_environment.main_address == "gpu07"


def test_precision_plugins():
    assert type(Fabric(accelerator="cpu", precision=32)._precision) is Precision
    with pytest.warns(UserWarning, match="16-mixed.*bf16-mixed"):
        plugin = Fabric(accelerator="cpu", precision="16-mixed")._precision
    assert isinstance(plugin, MixedPrecision) and plugin.name == "bf16-mixed"
    with pytest.raises(ValueError, match="pass only one"):
        Fabric(accelerator="cpu", precision="64-true", plugins=[Precision()])


def test_cli_flags_fill_unset_arguments_and_conflicts_are_errors(monkeypatch):
    monkeypatch.setenv("FABRICLITE_CLI_PRECISION", "bf16-mixed")
    assert Fabric(accelerator="cpu")._precision.name == "bf16-mixed"
    with pytest.raises(ValueError, match=r"precision='64-true'.*conflicts with `fabriclite run --precision bf16-mixed`"):
        Fabric(accelerator="cpu", precision="64-true")


@pytest.mark.slow  # a fresh interpreter importing torch and fabriclite: 1.8 s alone, 36 s at load 19
def test_import_is_light():
    import subprocess
    import sys

    code = ("import sys, torch; before = set(sys.modules); import fabriclite; new = set(sys.modules) - before; "
            "print(sorted(m for m in new if m.split('.')[0] in ('horovod', 'torch_xla', 'lightning', "
            "'lightning_fabric', 'tensorboard', 'tqdm', 'rich', 'mpi4py', 'torchft')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("value", ["16", 16, "bf16", "32", "16-true", "bf16-true"])
def test_mixed_precision_rejects_what_lightning_rejects(value):
    from lightning.fabric.plugins.precision.amp import MixedPrecision as LightningMixedPrecision

    with pytest.raises(ValueError) as lightning_error:
        LightningMixedPrecision(value, "cpu")
    with pytest.raises(ValueError) as ours:
        MixedPrecision(value, "cpu")
    assert str(ours.value) == str(lightning_error.value)
    assert f"precision={value!r}" in str(ours.value) and "'16-mixed' or 'bf16-mixed'" in str(ours.value)


def test_mixed_precision_bf16_with_a_scaler_is_rejected_as_lightning():
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match=r"`precision='bf16-mixed'` does not use a scaler, found"):
        MixedPrecision("bf16-mixed", "cpu", scaler=scaler)
    assert MixedPrecision("bf16-mixed", "cpu").dtype == torch.bfloat16
