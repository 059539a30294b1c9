"""Checkpoints: complete on every rank when save returns, exact resume, atomic under SIGKILL, Lightning
Fabric's files both ways, load semantics (in place, remainder, strict, filter, weights_only)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabriclite import Fabric
from helpers import REPO as REPO_PATH

REPO = str(REPO_PATH)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 3))


# ---------------------------------------------------------------------- on real ranks
def _save_then_read(fabric, path):
    model = _model(1)
    model, opt = fabric.setup(model, torch.optim.Adam(model.parameters()))
    fabric.backward(model(torch.ones(2, 5)).sum())
    opt.step()
    fabric.save(path, {"model": model, "optimizer": opt, "step": 5, "nested": {"a": [1, 2]}})
    ckpt = torch.load(path, weights_only=True)  # every rank, right away: the file must be complete
    return sorted(ckpt), ckpt["step"], sorted(ckpt["model"]), len(ckpt["optimizer"]["state"])


def test_every_rank_finds_the_complete_file_when_save_returns(pool2, tmp_path):
    path = str(tmp_path / "sub" / "ckpt.pt")
    for keys, step, model_keys, opt_state in pool2.run(_save_then_read, path):
        assert keys == ["model", "nested", "optimizer", "step"] and step == 5
        assert model_keys == ["0.bias", "0.weight", "2.bias", "2.weight"] and opt_state == 4
    assert os.listdir(tmp_path / "sub") == ["ckpt.pt"]  # no temporary file left behind


def _save_fails_on_rank_zero(fabric, path):
    with pytest.raises(OSError if fabric.global_rank == 0 else Exception) as info:  # others: rank 0's error
        fabric.save(path, {"x": 1})
    return "FileExistsError" in str(info.value) or isinstance(info.value, FileExistsError)


def test_a_failed_write_raises_on_every_rank(pool2, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    assert pool2.run(_save_fails_on_rank_zero, str(tmp_path / "file" / "ckpt.pt")) == [True, True]


def _train(fabric, path, resume: bool, epochs: int = 3):
    x = torch.randn(40, 5, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(1))
    fabric.seed_everything(11)

    def make(seed):
        model = _model(seed)
        model, opt = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.01))
        loader = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True))
        return model, opt, loader

    def epoch(model, opt, loader):
        losses = []
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            fabric.backward(loss)
            opt.step()
            losses.append(loss.item())
        return losses

    model, opt, loader = make(0)
    losses = [epoch(model, opt, loader)]
    start = 1
    if resume:
        fabric.save(path, {"model": model, "optimizer": opt, "loader": loader, "epoch": 1})
        model, opt, loader = make(99)  # a fresh run: other weights, empty optimizer, epoch 0 loader
        state = {"model": model, "optimizer": opt, "loader": loader, "epoch": 0}
        remainder = fabric.load(path, state)
        assert remainder == {} and state["epoch"] == 1 and loader.epoch == 1
        start = state["epoch"]
    for _ in range(start, epochs):
        losses.append(epoch(model, opt, loader))
    return losses


def test_resume_at_an_epoch_boundary_continues_with_the_same_losses(pool2, tmp_path):
    uninterrupted = pool2.run(_train, None, False)
    resumed = pool2.run(_train, str(tmp_path / "resume.ckpt"), True)
    assert resumed == uninterrupted


# ---------------------------------------------------------------------- atomic under SIGKILL
_KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    from fabriclite import Fabric

    path, mode = sys.argv[1], sys.argv[2]
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.save(path, {"version": 1, "w": torch.zeros(4)})
    real_fdopen = os.fdopen

    class Stalling:  # writes the first megabyte, then stops mid-file until killed
        def __init__(self, f):
            self.f, self.n = f, 0
        def write(self, b):
            if self.n > 2**20:
                self.f.flush()
                print("partial", flush=True)
                time.sleep(600)
            self.n += len(b)
            return self.f.write(b)
        def __getattr__(self, name):
            return getattr(self.f, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            self.f.close()

    if mode == "mid-write":
        os.fdopen = lambda *a, **k: Stalling(real_fdopen(*a, **k))
    else:  # before the rename: the new file is written but not yet in place
        os.fsync = lambda fd: (print("partial", flush=True), time.sleep(600))
    fabric.save(path, {"version": 2, "w": torch.ones(4_000_000)})
""")


@pytest.mark.parametrize("mode", ["mid-write", "before-rename"])
def test_sigkill_while_saving_keeps_the_previous_checkpoint(tmp_path, mode):
    script = tmp_path / "kill_me.py"
    script.write_text(_KILL_SCRIPT)
    target = tmp_path / "ckpt" / "last.ckpt"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, str(script), str(target), mode], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout.readline().strip() == "partial"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    ckpt = torch.load(target, weights_only=True)
    assert ckpt["version"] == 1 and torch.equal(ckpt["w"], torch.zeros(4))
    leftovers = [p for p in os.listdir(target.parent) if p != "last.ckpt"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".last.ckpt.tmp-")  # the partial file is beside it
    assert os.path.getsize(target.parent / leftovers[0]) > 2**20


# ---------------------------------------------------------------------- load semantics, one process
def test_load_restores_in_place_and_returns_the_rest(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model = _model(1)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    fabric.backward(model(torch.ones(1, 5)).sum())
    opt.step()
    path = tmp_path / "c.ckpt"
    fabric.save(path, {"model": model, "optimizer": opt, "epoch": 4, "extra": "kept"})

    fresh = _model(2)
    fresh, fresh_opt = fabric.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
    state = {"model": fresh, "optimizer": fresh_opt, "epoch": 0}
    assert fabric.load(path, state) == {"extra": "kept"}
    assert state["epoch"] == 4 and state["model"] is fresh and fresh_opt.param_groups[0]["lr"] == 0.5
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    assert sorted(fabric.load(path)) == ["epoch", "extra", "model", "optimizer"]
    with pytest.raises(KeyError, match="missing_key"):
        fabric.load(path, {"missing_key": 1})
    assert fabric.load(path, {"missing_key": 1, "epoch": 0}, strict=False)["extra"] == "kept"
    with pytest.raises(FileNotFoundError, match="nope"):
        fabric.load(tmp_path / "nope.ckpt")


def test_save_filter_and_load_raw(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(_model(1))
    fabric.save(tmp_path / "f.ckpt", {"model": model}, filter={"model": lambda name, value: "weight" in name})
    assert sorted(torch.load(tmp_path / "f.ckpt")["model"]) == ["0.weight", "2.weight"]
    with pytest.raises(ValueError, match="not keys of the state"):
        fabric.save(tmp_path / "g.ckpt", {"model": model}, filter={"other": lambda n, v: True})
    with pytest.raises(TypeError, match="not callable"):
        fabric.save(tmp_path / "g.ckpt", {"model": model}, filter={"model": 1})
    torch.save(_model(7).state_dict(), tmp_path / "raw.pt")
    fabric.load_raw(tmp_path / "raw.pt", model)
    assert torch.equal(model.module[0].weight, _model(7)[0].weight)


def test_weights_only_refuses_arbitrary_objects(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.save(tmp_path / "obj.ckpt", {"obj": _Custom()})
    with pytest.raises(Exception, match="weights_only|Unsupported global"):
        fabric.load(tmp_path / "obj.ckpt", weights_only=True)
    assert isinstance(fabric.load(tmp_path / "obj.ckpt", weights_only=False)["obj"], _Custom)


class _Custom:
    pass


# ---------------------------------------------------------------------- Lightning Fabric, both ways
def test_checkpoints_move_between_lightning_fabric_and_fabriclite(tmp_path):
    import lightning.fabric as lightning_fabric  # a test extra: missing, it fails here, loudly

    lf = lightning_fabric.Fabric(accelerator="cpu", devices=1)
    fl = Fabric(accelerator="cpu", devices=1)

    def trained(fabric, seed):
        model = _model(seed)
        model, opt = fabric.setup(model, torch.optim.Adam(model.parameters()))
        fabric.backward(model(torch.ones(2, 5)).sum())
        opt.step()
        return model, opt

    for saver, loader in ((lf, fl), (fl, lf)):
        model, opt = trained(saver, 1)
        path = tmp_path / f"{type(saver).__module__}.ckpt"
        saver.save(path, {"model": model, "optimizer": opt, "epoch": 3})
        fresh, fresh_opt = trained(loader, 2)
        state = {"model": fresh, "optimizer": fresh_opt}
        remainder = loader.load(path, state)
        assert remainder == {"epoch": 3}
        for a, b in zip(model.parameters(), fresh.parameters()):
            assert torch.equal(a, b)
        assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
