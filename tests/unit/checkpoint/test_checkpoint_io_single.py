"""Checkpoints in one process (single_device strategy): Lightning's CheckpointIO API (TorchCheckpointIO, a user's
plugin through every checkpoint call), AsyncCheckpointIO (snapshot, one in flight, errors never lost), damaged
checkpoints (load_latest's checksums and fallback, fabric.load's error), fsspec ``memory://`` URLs, and the
loader position's world-size / batch-size check."""
from __future__ import annotations

import json
import os
import threading
import warnings
from typing import Any, Dict, List, Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader

from fabriclite import Fabric
from fabriclite.checkpoint.async_save import AsyncSaveError
from fabriclite.checkpoint.integrity import CorruptCheckpointError
from fabriclite.checkpoint.latest import NoLoadableCheckpointError
from fabriclite.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO


class RecordingIO(CheckpointIO):
    """A user's plugin: torch.save / torch.load, every call recorded; ``gate`` (an Event) holds writes back."""

    def __init__(self, gate: Optional[threading.Event] = None, fail_on: str = "") -> None:
        self.calls: List[tuple] = []
        self.gate, self.fail_on = gate, fail_on
        self.writing = 0
        self.overlaps = 0

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.writing += 1
        self.overlaps += self.writing > 1
        try:
            self.calls.append(("save", os.path.basename(path), storage_options))
            if self.gate is not None:
                assert self.gate.wait(60), "the test never opened the gate"
            if self.fail_on and self.fail_on in os.fspath(path):
                raise OSError(28, "No space left on device")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(checkpoint, path)
        finally:
            self.writing -= 1

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        self.calls.append(("load", os.path.basename(path)))
        return torch.load(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.calls.append(("remove", os.path.basename(path)))
        os.remove(path)


def _setup(fabric: Fabric, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    return fabric.setup(model, optimizer)


def _step(model, optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()


def _weights(model) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------- Lightning's API
def test_torch_checkpoint_io_round_trip_and_lightnings_errors(tmp_path):
    io = TorchCheckpointIO()
    path = tmp_path / "sub" / "a.ckpt"
    io.save_checkpoint({"x": torch.arange(3), "step": 2}, path)  # creates the directory, as Lightning's does
    loaded = io.load_checkpoint(path)
    assert torch.equal(loaded["x"], torch.arange(3)) and loaded["step"] == 2
    assert os.listdir(tmp_path / "sub") == ["a.ckpt"]  # no temporary left beside it
    with pytest.raises(TypeError, match="storage_options.* is not supported for `TorchCheckpointIO`"):
        io.save_checkpoint({}, tmp_path / "b.ckpt", storage_options={"compress": True})
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found: .*missing.ckpt"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    io.remove_checkpoint(path)
    io.remove_checkpoint(path)  # nothing there: no error, as in Lightning
    assert not path.exists()


@pytest.mark.parametrize("damage", ["half", "empty", "garbage"])
def test_an_unreadable_file_is_an_error_naming_it(tmp_path, damage):
    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer = _setup(fabric)
    path = tmp_path / "c.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer})
    data = path.read_bytes()
    path.write_bytes({"half": data[: len(data) // 2], "empty": b"", "garbage": b"half a checkpoint"}[damage])
    with pytest.raises(CorruptCheckpointError, match=f"Checkpoint {path} cannot be loaded: .*truncated, damaged"):
        fabric.load(path, {"model": model, "optimizer": optimizer})


def test_weights_only_refusals_keep_torchs_own_message(tmp_path):
    path = tmp_path / "obj.ckpt"
    torch.save({"obj": threading.Event}, path)
    with pytest.raises(Exception, match="Weights only load failed") as info:
        TorchCheckpointIO().load_checkpoint(path, weights_only=True)
    assert not isinstance(info.value, CorruptCheckpointError)


def test_a_users_checkpoint_io_writes_reads_and_removes_every_checkpoint(tmp_path):
    io = RecordingIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    assert fabric.strategy.checkpoint_io is io
    model, optimizer = _setup(fabric)
    for step in range(3):
        _step(model, optimizer)
        fabric.save(tmp_path / f"s{step}.ckpt", {"model": model, "optimizer": optimizer, "step": step}, keep=2)
    fabric.save(tmp_path / "filtered.ckpt", {"model": model}, filter={"model": lambda name, _: name == "bias"})
    expected = _weights(model)
    fresh, fresh_opt = _setup(fabric, seed=1)
    state = {"model": fresh, "optimizer": fresh_opt, "step": -1}
    assert fabric.load_latest(tmp_path, state) == str(tmp_path / "s2.ckpt")
    assert state["step"] == 2 and _equal(_weights(fresh), expected)
    assert sorted(fabric.load(tmp_path / "filtered.ckpt")["model"]) == ["bias"]
    fabric.strategy.save_checkpoint(tmp_path / "opts.ckpt", {"step": 9}, storage_options={"level": 3})
    assert io.calls == [("save", "s0.ckpt", None), ("save", "s1.ckpt", None), ("save", "s2.ckpt", None),
                        ("remove", "s0.ckpt"), ("save", "filtered.ckpt", None), ("load", "s2.ckpt"),
                        ("load", "filtered.ckpt"), ("save", "opts.ckpt", {"level": 3})]
    entries = json.loads((tmp_path / "fabriclite-manifest.json").read_text())["checkpoints"]
    assert [e["name"] for e in entries] == ["s1.ckpt", "s2.ckpt"]
    assert entries[-1]["files"]["s2.ckpt"]["size"] == (tmp_path / "s2.ckpt").stat().st_size


def test_plugins_are_checked_like_lightnings(no_launch_env):
    from fabriclite.strategies import DDPStrategy, FSDPStrategy

    with pytest.raises(ValueError, match="two CheckpointIO plugins"):
        Fabric(accelerator="cpu", devices=1, plugins=[TorchCheckpointIO(), RecordingIO()])
    with pytest.raises(TypeError, match="expected a ClusterEnvironment, a Precision plugin or a CheckpointIO"):
        Fabric(accelerator="cpu", devices=1, plugins=[object()])
    with pytest.raises(ValueError, match="checkpoint_io set through both strategy class and plugins"):
        Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(checkpoint_io=RecordingIO()), plugins=[RecordingIO()])
    with pytest.raises(NotImplementedError, match="`FSDPStrategy` does not support setting a `CheckpointIO`"):
        Fabric(accelerator="cpu", devices=2, strategy="fsdp", plugins=[RecordingIO()])
    with pytest.raises(NotImplementedError, match=r"pass FSDPStrategy\(async_save=True\)"):
        Fabric(accelerator="cpu", devices=2, strategy="fsdp", plugins=[AsyncCheckpointIO()])
    fsdp = FSDPStrategy()
    with pytest.raises(NotImplementedError, match="`FSDPStrategy` does not use the `CheckpointIO` plugin"):
        fsdp.checkpoint_io
    with pytest.raises(TypeError, match="storage_options=...\\)` is not supported because `FSDPStrategy`"):
        fsdp.save_checkpoint("unused", {"step": 1}, storage_options={})
    with pytest.raises(TypeError, match="async_save='yes'"):
        FSDPStrategy(async_save="yes")
    with pytest.raises(TypeError, match="wrap the plugin that writes"):
        AsyncCheckpointIO(AsyncCheckpointIO())


# ---------------------------------------------------------------------- asynchronous saves
def test_an_async_save_returns_before_the_write_and_keeps_the_state_it_was_given(tmp_path):
    gate = threading.Event()
    inner = RecordingIO(gate)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AsyncCheckpointIO(inner)])
    model, optimizer = _setup(fabric)
    _step(model, optimizer)
    at_save = _weights(model)
    fabric.save(tmp_path / "a.ckpt", {"model": model, "optimizer": optimizer, "step": 1}, keep=1)
    assert not (tmp_path / "a.ckpt").exists()  # save returned; the write waits for the gate
    for _ in range(3):
        _step(model, optimizer)  # later steps change the live tensors in place
    assert not _equal(_weights(model), at_save)
    written = json.loads((tmp_path / "fabriclite-manifest.json").read_text())
    assert written["checkpoints"] == [] and [p["name"] for p in written["pending"]] == ["a.ckpt"]  # only pending
    gate.set()
    fabric.strategy.wait_for_checkpoints()
    assert _equal(torch.load(tmp_path / "a.ckpt", weights_only=True)["model"], at_save)
    names = [e["name"] for e in json.loads((tmp_path / "fabriclite-manifest.json").read_text())["checkpoints"]]
    assert names == ["a.ckpt"]


def test_the_default_async_writer_copies_each_snapshot_into_the_last_ones_memory(tmp_path):
    io = AsyncCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model, optimizer = _setup(fabric)
    held, expected = [], []
    for step in range(3):
        _step(model, optimizer)
        fabric.save(tmp_path / f"s{step}.ckpt", {"model": model, "optimizer": optimizer})
        expected.append(_weights(model))
        held.append(sorted(t.data_ptr() for t in io._buffers))
    fabric.strategy.wait_for_checkpoints()
    assert held[0] == held[1] == held[2] and len(held[0]) == 2 + 2 * 2 + 2  # weight, bias; exp_avg(_sq), step each
    for step in range(3):  # every file holds its own step's state, although the memory was the same
        assert _equal(torch.load(tmp_path / f"s{step}.ckpt", weights_only=True)["model"], expected[step])


def test_a_second_async_save_waits_for_the_first_and_load_latest_sees_the_newest(tmp_path):
    gate = threading.Event()
    inner = RecordingIO(gate)
    io = AsyncCheckpointIO(inner)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model, optimizer = _setup(fabric)
    fabric.save(tmp_path / "s0.ckpt", {"model": model, "step": 0}, keep=5)
    second = threading.Thread(target=fabric.save, args=(tmp_path / "s1.ckpt", {"model": model, "step": 1}),
                              kwargs={"keep": 5})
    second.start()
    second.join(0.5)  # the second save waits for the first (the gate is closed)
    assert second.is_alive() and [c[1] for c in inner.calls] == ["s0.ckpt"]
    gate.set()
    second.join(60)
    state = {"step": -1}
    assert fabric.load_latest(tmp_path, state) == str(tmp_path / "s1.ckpt") and state["step"] == 1
    assert inner.overlaps == 0 and [c[1] for c in inner.calls][:2] == ["s0.ckpt", "s1.ckpt"]


def test_a_failed_background_write_is_raised_by_the_next_save_and_at_teardown(tmp_path):
    inner = RecordingIO(fail_on="bad")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AsyncCheckpointIO(inner)])
    model, _ = _setup(fabric)
    fabric.save(tmp_path / "good.ckpt", {"model": model}, keep=3)
    fabric.save(tmp_path / "bad.ckpt", {"model": model}, keep=3)  # fails in the background
    with pytest.raises(AsyncSaveError, match=f"asynchronous save of {tmp_path / 'bad.ckpt'} failed: OSError.*No "
                                             "space left on device"):
        fabric.save(tmp_path / "next.ckpt", {"model": model}, keep=3)
    assert fabric.load_latest(tmp_path, {"model": model}) == str(tmp_path / "good.ckpt")  # bad never recorded
    fabric.save(tmp_path / "bad2.ckpt", {"model": model}, keep=3)
    with pytest.raises(AsyncSaveError, match="bad2.ckpt"):
        fabric.strategy.teardown()  # the end of the job
    fabric.strategy.teardown()  # raised once: a second teardown is quiet


# ---------------------------------------------------------------------- damaged checkpoints and load_latest
DAMAGES = ("none", "flip", "truncate", "delete")


def _damage(path, how: str) -> None:
    if how == "flip":
        data = bytearray(path.read_bytes())
        data[len(data) * 2 // 3] ^= 0x5A  # inside a tensor's bytes: torch.load would not notice
        path.write_bytes(bytes(data))
    elif how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "delete":
        path.unlink()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damages=st.lists(st.sampled_from(DAMAGES), min_size=1, max_size=4))
def test_load_latest_loads_the_newest_undamaged_checkpoint_or_names_every_one_it_tried(tmp_path_factory, damages):
    directory = tmp_path_factory.mktemp("latest")
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(nn.Linear(64, 64))
    written = []
    for step, how in enumerate(damages):
        with torch.no_grad():
            model.weight.fill_(step)
        fabric.save(directory / f"s{step}.ckpt", {"model": model, "step": step}, keep=len(damages))
        written.append(_weights(model))
    for step, how in enumerate(damages):
        _damage(directory / f"s{step}.ckpt", how)
    state = {"model": model, "step": -1}
    good = [step for step, how in enumerate(damages) if how == "none"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not good:
            with pytest.raises(NoLoadableCheckpointError) as info:
                fabric.load_latest(directory, state)
            assert [os.path.basename(path) for path, _ in info.value.tried] == \
                [f"s{step}.ckpt" for step in reversed(range(len(damages)))]
            assert state["step"] == -1
            return
        path = fabric.load_latest(directory, state)
    assert path == str(directory / f"s{good[-1]}.ckpt") and state["step"] == good[-1]
    assert _equal(_weights(model), written[good[-1]])
    skipped = [str(w.message) for w in caught if "load_latest: skipping" in str(w.message)]
    assert len(skipped) == len(damages) - 1 - good[-1]
    reasons = {"flip": "does not hold the bytes that were written", "truncate": "were written (truncated",
               "delete": "is missing"}
    for message, step in zip(skipped, reversed(range(good[-1] + 1, len(damages)))):
        assert f"s{step}.ckpt" in message and reasons[damages[step]] in message, message


def test_a_checkpoint_without_digests_that_does_not_load_is_skipped_but_a_key_error_is_raised(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup(nn.Linear(4, 4))
    for step in range(2):
        fabric.save(tmp_path / f"s{step}.ckpt", {"model": model, "step": step}, keep=2)
    manifest = tmp_path / "fabriclite-manifest.json"
    data = json.loads(manifest.read_text())
    for entry in data["checkpoints"]:
        del entry["files"]  # as an older fabriclite (or a plugin writing elsewhere) recorded them
    manifest.write_text(json.dumps(data))
    (tmp_path / "s1.ckpt").write_bytes(b"not a checkpoint")
    state = {"model": model, "step": -1}
    with pytest.warns(UserWarning, match="skipping the checkpoint .*s1.ckpt: Checkpoint .* cannot be loaded"):
        assert fabric.load_latest(tmp_path, state) == str(tmp_path / "s0.ckpt")
    with pytest.raises(KeyError, match="'absent'"):  # strict: an older checkpoint would not help
        fabric.load_latest(tmp_path, {"model": model, "absent": 1})


# ---------------------------------------------------------------------- fsspec URLs
def test_memory_urls_save_load_keep_and_load_latest():
    import fsspec

    root = f"memory://fabriclite-test-{os.getpid()}"
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AsyncCheckpointIO()])
    model, optimizer = _setup(fabric)
    for step in range(3):
        _step(model, optimizer)
        fabric.save(f"{root}/run/s{step}.ckpt", {"model": model, "optimizer": optimizer, "step": step}, keep=2)
    expected = _weights(model)
    fresh, fresh_opt = _setup(fabric, seed=3)
    state = {"model": fresh, "optimizer": fresh_opt, "step": -1}
    assert fabric.load_latest(f"{root}/run", state) == f"{root}/run/s2.ckpt"
    assert state["step"] == 2 and _equal(_weights(fresh), expected)
    fs = fsspec.filesystem("memory")
    names = sorted(os.path.basename(p) for p in fs.ls(f"{root[len('memory://'):]}/run", detail=False))
    assert names == ["fabriclite-manifest.json", "s1.ckpt", "s2.ckpt"]  # s0 dropped by keep=2, no temporaries
    assert fabric.load(f"{root}/run/s1.ckpt")["step"] == 1
    fs.rm(f"{root[len('memory://'):]}", recursive=True)


# ---------------------------------------------------------------------- the loader's position
def test_a_mid_epoch_loader_state_at_another_batch_size_or_world_size_names_both():
    fabric = Fabric(accelerator="cpu", devices=1)
    loader = fabric.setup_dataloaders(DataLoader(list(range(20)), batch_size=4))
    iterator = iter(loader)
    next(iterator), next(iterator)
    state = loader.state_dict()
    assert state == {"epoch": 0, "batch": 2, "world_size": 1, "batch_size": 4, "dataset_length": 20}
    other = fabric.setup_dataloaders(DataLoader(list(range(20)), batch_size=5))
    with pytest.raises(ValueError, match="batch 2 of epoch 0, saved with batch_size 4; this loader has batch_size 5"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="saved with world_size 2; this loader has world_size 1. That state cannot"):
        loader.load_state_dict({**state, "world_size": 2})  # not dealt by a DistributedSampler: it cannot move
    with pytest.raises(ValueError, match="saved for a dataset of 20 samples; this loader's dataset has 21"):
        fabric.setup_dataloaders(DataLoader(list(range(21)), batch_size=4)).load_state_dict(state)
    other.load_state_dict({**state, "batch": 0})  # an epoch boundary loads at any size
    other.load_state_dict({"epoch": 0, "batch": 2})  # so does a state from before the sizes were recorded
    assert other.state_dict()["batch"] == 2
