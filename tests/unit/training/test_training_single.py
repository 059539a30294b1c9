"""Training surface in one process: precisions, clipping, init contexts, callbacks, seeding, progress bar,
wrappers and imports. Runs in the test process (single_device strategy); CUDA cases skip without a GPU."""
from __future__ import annotations

import subprocess
import sys
import warnings
from functools import partial

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabriclite import Fabric
from fabriclite.training.seeding import worker_init_fn

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _step(fabric: Fabric):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(5, 4, device=fabric.device)
    y = torch.randint(0, 2, (5,), device=fabric.device)
    out = model(x)
    loss = nn.functional.cross_entropy(out.float(), y)
    fabric.backward(loss)
    opt.step()
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return out, loss, next(model.parameters()).dtype, changed


#: (precision, parameter dtype, output dtype): floating outputs come back in the default dtype in every mode that
#: casts inputs (Lightning's plugins: convert_output), so the output is float32 throughout
CPU_PRECISIONS = [
    ("32-true", torch.float32, torch.float32), ("64-true", torch.float64, torch.float32),
    ("bf16-mixed", torch.float32, torch.float32), ("16-true", torch.float16, torch.float32),
    ("bf16-true", torch.bfloat16, torch.float32), (32, torch.float32, torch.float32),
    ("bf16", torch.float32, torch.float32),
]


@pytest.mark.parametrize("precision,param_dtype,out_dtype", CPU_PRECISIONS)
def test_each_precision_runs_a_step_on_cpu(precision, param_dtype, out_dtype):
    out, loss, dtype, changed = _step(Fabric(accelerator="cpu", devices=1, precision=precision))
    assert dtype == param_dtype and out.dtype == out_dtype
    assert torch.isfinite(loss) and changed


def test_16_mixed_on_cpu_becomes_bf16_mixed_with_a_warning():
    with pytest.warns(UserWarning, match="bf16-mixed"):
        fabric = Fabric(accelerator="cpu", devices=1, precision="16-mixed")
    assert fabric._precision.name == "bf16-mixed"
    with fabric.autocast():
        assert torch.randn(2, 2).matmul(torch.randn(2, 2)).dtype == torch.bfloat16
    out, loss, dtype, changed = _step(fabric)
    assert dtype == torch.float32 and out.dtype == torch.float32 and changed


@needs_cuda
@pytest.mark.parametrize("precision", ["32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"])
def test_each_precision_runs_a_step_on_cuda(precision):
    fabric = Fabric(accelerator="cuda", devices=1, precision=precision)
    out, loss, dtype, changed = _step(fabric)
    assert torch.isfinite(loss) and changed and out.device.type == "cuda"
    if precision == "16-mixed":
        assert fabric._precision.scaler is not None


@needs_cuda
def test_16_mixed_on_cuda_requires_fabric_backward():
    fabric = Fabric(accelerator="cuda", devices=1, precision="16-mixed")
    model = fabric.setup(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="fabric.backward"):
        model(torch.ones(1, 2, device="cuda")).sum().backward()


@needs_cuda
def test_optimizer_state_follows_the_model_to_the_gpu():
    model = nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()  # state on the CPU
    fabric = Fabric(accelerator="cuda", devices=1)
    model, opt = fabric.setup(model, opt)
    assert {opt.state[p]["exp_avg"].device.type for p in model.parameters()} == {"cuda"}
    fabric.backward(model(torch.ones(1, 3, device="cuda")).sum())
    opt.step()


def test_bad_precision_names_the_valid_ones():
    with pytest.raises(ValueError, match="bf16-true"):
        Fabric(accelerator="cpu", devices=1, precision="8-bit")


# ---------------------------------------------------------------------- clipping
def test_clip_gradients_by_norm_and_value():
    fabric = Fabric(accelerator="cpu", devices=1)
    model = nn.Linear(3, 1, bias=False)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1.0))
    fabric.backward(model(torch.full((1, 3), 10.0)).sum())
    norm = fabric.clip_gradients(model, opt, max_norm=1.0)
    assert norm == pytest.approx(10.0 * 3 ** 0.5)
    assert model.weight.grad.norm() == pytest.approx(1.0, rel=1e-5)
    model.weight.grad.fill_(5.0)
    assert fabric.clip_gradients(model, opt, clip_val=0.5) is None
    assert torch.all(model.weight.grad == 0.5)
    for kwargs in ({}, {"clip_val": 1.0, "max_norm": 1.0}):
        with pytest.raises(ValueError, match="exactly one"):
            fabric.clip_gradients(model, opt, **kwargs)
    model.weight.grad.fill_(float("inf"))
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric.clip_gradients(model, opt, max_norm=1.0)


# ---------------------------------------------------------------------- init contexts, to_device
def test_init_module_and_init_tensor_follow_precision_and_device():
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-true")
    with fabric.init_module():
        layer = nn.Linear(2, 2)
    with fabric.init_tensor():
        t = torch.ones(2)
    assert layer.weight.dtype == torch.bfloat16 and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert torch.get_default_dtype() == torch.float32
    with Fabric(accelerator="cpu", devices=1).init_module(empty_init=True):
        torch.manual_seed(0)
        skipped = nn.Linear(64, 64)
    torch.manual_seed(0)
    assert not torch.equal(skipped.weight, nn.Linear(64, 64).weight)
    batch = fabric.to_device({"x": torch.ones(1), "y": [torch.zeros(1)]})
    assert batch["x"].device == fabric.device and fabric.to_device(layer) is layer


# ---------------------------------------------------------------------- callbacks
class _Recorder:
    def __init__(self):
        self.calls = []

    def on_train_epoch_end(self, results):  # takes fewer keyword arguments than are passed
        self.calls.append(("epoch_end", results))

    def on_after_setup(self, fabric, module):
        self.calls.append(("setup", type(module).__name__))

    def on_after_optimizer_step(self, strategy, optimizer):
        self.calls.append(("step", type(optimizer).__name__))


class _Other:
    on_train_epoch_end = "not callable"

    def anything(self, *args, **kwargs):
        return args, kwargs


def test_callbacks_are_called_by_hook_name():
    recorder = _Recorder()
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[recorder, _Other()])
    model = nn.Linear(1, 1)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.ones(1, 1)).sum())
    opt.step()
    with pytest.warns(UserWarning, match="not callable"):
        fabric.call("on_train_epoch_end", results={"loss": 1.0}, extra="ignored")
    fabric.call("hook_nobody_has", 1, 2)
    assert recorder.calls == [("setup", "FabricModule"), ("step", "SGD"), ("epoch_end", {"loss": 1.0})]
    assert Fabric(accelerator="cpu", devices=1, callbacks=recorder)._callbacks == [recorder]


# ---------------------------------------------------------------------- seeding
class _Noise(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        return torch.tensor([float(info.id), torch.rand(()).item()])


def _worker_draws(rank: int):
    Fabric.seed_everything(42)
    loader = DataLoader(_Noise(), batch_size=1, num_workers=2, worker_init_fn=partial(worker_init_fn, rank=rank))
    rows = torch.cat(list(loader))
    return {int(w): v for w, v in rows.tolist()[:2]}  # first sample of worker 0 and of worker 1


def test_worker_seeds_differ_across_ranks_and_workers_and_repeat():
    r0, r0_again, r1 = _worker_draws(0), _worker_draws(0), _worker_draws(1)
    assert r0 == r0_again
    values = [r0[0], r0[1], r1[0], r1[1]]
    assert len(set(values)) == 4


def test_seed_everything_seeds_and_enables_worker_seeding(monkeypatch):
    import numpy as np

    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert Fabric.seed_everything(3) == 3
    a = (torch.rand(1), np.random.rand(), __import__("random").random())
    Fabric.seed_everything(3)
    assert (torch.rand(1), np.random.rand(), __import__("random").random()) == a
    fabric = Fabric(accelerator="cpu", devices=1)
    loader = fabric.setup_dataloaders(DataLoader(_Noise(), num_workers=1))
    assert loader.worker_init_fn.func is worker_init_fn
    with pytest.raises(ValueError, match="out of range"):
        Fabric.seed_everything(-1)


# ---------------------------------------------------------------------- misc
def test_progress_bar_of_a_single_process_draws_and_null_bar_is_silent(capsys):
    # (that other ranks draw nothing is tested on two real ranks in test_training.py)
    fabric = Fabric(accelerator="cpu", devices=1)
    assert list(fabric.progress_bar(range(3), desc="bar-x", disable=False)) == [0, 1, 2]
    drawn = capsys.readouterr().err
    assert "bar-x" in drawn and "3/3" in drawn, drawn
    from fabriclite.training.progress_bar import NullBar, progress_bar

    silent = progress_bar(range(3), enabled=False, desc="x")
    assert isinstance(silent, NullBar) and list(silent) == [0, 1, 2]
    with silent as bar:
        bar.set_postfix(loss=1.0)
        bar.update(2)
    assert bar.n == 2
    assert capsys.readouterr() == ("", "")  # the NullBar drew nothing


def test_single_device_no_backward_sync_is_a_silent_no_op():
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(nn.Linear(1, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with fabric.no_backward_sync(model):
            fabric.backward(model(torch.ones(1, 1)).sum())
    assert model.weight.grad is not None


def test_setup_returns_what_lightning_returns():
    fabric = Fabric(accelerator="cpu", devices=1)
    m = nn.Linear(1, 1)
    o1, o2 = torch.optim.SGD(m.parameters(), lr=1), torch.optim.Adam(m.parameters())
    sched = torch.optim.lr_scheduler.StepLR(o1, 1)
    out = fabric.setup(m, o1, o2, scheduler=sched)
    assert len(out) == 4 and out[3] is sched and isinstance(out[2], torch.optim.Adam)
    module = fabric.setup_module(nn.Linear(1, 1))
    opt = fabric.setup_optimizers(torch.optim.SGD(module.parameters(), lr=1))
    assert isinstance(opt, torch.optim.SGD) and type(module).__name__ == "FabricModule"


def test_setup_before_launch_says_to_launch():
    fabric = Fabric(accelerator="cpu", devices=2)
    with pytest.raises(RuntimeError, match=r"fabric.launch\(\) first"):
        fabric.setup(nn.Linear(1, 1))


def test_import_fabriclite_imports_no_optional_package():
    code = ("import sys, torch; before = set(sys.modules); import fabriclite, fabriclite.loggers; "
            "new = set(sys.modules) - before; "
            "print(sorted(m for m in new if m.split('.')[0] in ('tensorboard', 'tqdm', 'lightning', "
            "'lightning_fabric', 'rich') or m.startswith('torch.utils.tensorboard')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
