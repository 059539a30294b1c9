"""Resume helpers on real ranks: the loader's position inside an epoch, every rank's random states
(``resume_state``), ``save(keep=K)`` with its manifest and ``load_latest``, and an in-process exact resume
checked bit for bit against the same run uninterrupted."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from fabriclite import Fabric
from fabriclite.checkpoint import manifest as manifest_mod
from fabriclite.distributed import rendezvous


class Recording(Dataset):
    """Items 0..n-1; remembers which indices were loaded."""

    def __init__(self, n: int) -> None:
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded.append(i)
        return i


def _batches(loader, limit=None):
    out = []
    for batch in loader:
        out.append(batch.tolist())
        if limit is not None and len(out) == limit:
            break
    return out


# ---------------------------------------------------------------------- the loader's position
def _loader_positions(fabric):
    fabric.seed_everything(3, verbose=False)
    reference = fabric.setup_dataloaders(DataLoader(Recording(22), batch_size=3, shuffle=True))
    reference.set_epoch(1)
    whole = _batches(reference)
    first = fabric.setup_dataloaders(DataLoader(Recording(22), batch_size=3, shuffle=True))
    _batches(first)  # epoch 0
    head = _batches(first, limit=2)  # epoch 1, two batches, then a checkpoint
    state = first.state_dict()
    dataset = Recording(22)
    resumed = fabric.setup_dataloaders(DataLoader(dataset, batch_size=3, shuffle=True))
    resumed.load_state_dict(state)
    epoch_after_load = resumed.epoch
    tail = _batches(resumed)
    skipped = {i for batch in head for i in batch}
    old = fabric.setup_dataloaders(DataLoader(Recording(22), batch_size=3, shuffle=True))
    old.load_state_dict({"epoch": 1})  # a checkpoint from before positions: the epoch's start
    return (state, epoch_after_load, whole == head + tail, sorted(skipped & set(dataset.loaded)),
            resumed.state_dict(), _batches(old) == whole)


def test_a_mid_epoch_state_resumes_with_the_next_batch_without_loading_the_skipped_ones(pool2):
    for state, epoch, same, loaded_again, after, old_ok in pool2.run(_loader_positions):
        sizes = {"world_size": 2, "batch_size": 3, "dataset_length": 22, "seed": 3, "shuffle": True}
        assert state == {"epoch": 1, "batch": 2, **sizes, "start": 0, "samples": 12} and epoch == 1
        assert same, "the resumed epoch is not the rest of the uninterrupted one"
        assert loaded_again == []  # the skipped batches' samples were never loaded
        assert after == {"epoch": 2, "batch": 0, **sizes, "start": 0, "samples": 0}
        assert old_ok


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


def test_an_iterable_dataset_discards_the_skipped_batches_with_a_warning():
    fabric = Fabric(accelerator="cpu", devices=1)
    whole = _batches(fabric.setup_dataloaders(DataLoader(Stream(), batch_size=2)))
    first = fabric.setup_dataloaders(DataLoader(Stream(), batch_size=2))
    head = _batches(first, limit=3)
    resumed = fabric.setup_dataloaders(DataLoader(Stream(), batch_size=2))
    resumed.load_state_dict(first.state_dict())
    with pytest.warns(UserWarning, match="first 3 batches"):
        tail = _batches(resumed)
    assert head + tail == whole


def test_a_bad_loader_state_is_a_clear_error():
    loader = Fabric(accelerator="cpu", devices=1).setup_dataloaders(DataLoader(Recording(4)))
    with pytest.raises(ValueError, match="epoch and batch must be >= 0"):
        loader.load_state_dict({"epoch": 1, "batch": -2})
    with pytest.raises(ValueError, match="'epoch'"):
        loader.load_state_dict({"batch": 1})


# ---------------------------------------------------------------------- every rank's random states
def _draws():
    return torch.rand(3).tolist(), random.random()


def _rng_roundtrip(fabric, path):
    torch.manual_seed(100 + fabric.global_rank)
    random.seed(200 + fabric.global_rank)
    fabric.save(path, {"resume": fabric.resume_state()})
    expected = _draws()
    torch.manual_seed(0)
    random.seed(0)
    fabric.load(path, {"resume": fabric.resume_state()})
    return expected, _draws()


def test_resume_state_restores_each_ranks_own_generators(pool2, tmp_path):
    path = str(tmp_path / "rng.ckpt")
    (e0, a0), (e1, a1) = pool2.run(_rng_roundtrip, path)
    assert e0 == a0 and e1 == a1
    assert e0 != e1  # each rank got its own states back, not rank 0's
    saved = torch.load(path, weights_only=True)["resume"]  # loadable without trusting the file
    assert saved["world_size"] == 2 and len(saved["ranks"]) == 2


def _rng_elastic(fabric, path):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(path, {"resume": fabric.resume_state()})
    return _draws(), [str(w.message) for w in caught if "Elastic resume" in str(w.message)]


def test_a_different_world_size_restores_the_old_ranks_and_derives_the_new_ones(pool2, pool3, tmp_path):
    two, three = str(tmp_path / "two.ckpt"), str(tmp_path / "three.ckpt")
    (e0, _), (e1, _) = pool2.run(_rng_roundtrip, two)
    grown = pool3.run(_rng_elastic, two)
    again = pool3.run(_rng_elastic, two)
    assert [g[0] for g in grown[:2]] == [e0, e1]  # ranks 0 and 1 existed: their own states
    assert grown[2][0] == again[2][0] and grown[2][0] not in (e0, e1)  # rank 2 is new: derived, deterministic
    (message,) = grown[0][1]  # one warning, on rank 0 only
    assert grown[1][1] == grown[2][1] == []
    assert "saved by 2 ranks and this run has 3: ranks 0-1 restored their own; rank 2 is new: each seeded" in message
    (f0, _), (f1, _), (f2, _) = pool3.run(_rng_roundtrip, three)
    shrunk = pool2.run(_rng_elastic, three)
    assert [s[0] for s in shrunk] == [f0, f1]
    assert "the states of rank 2 were not used" in shrunk[0][1][0]
    fabric = Fabric(accelerator="cpu", devices=1)  # one process of its own: rank 0's states
    fabric.load(two, {"resume": fabric.resume_state()})
    assert _draws() == e0


# ---------------------------------------------------------------------- save(keep=K), manifest, load_latest
def _keep_two(fabric, directory):
    for step in (1, 2, 3, 4):
        fabric.save(os.path.join(directory, f"step-{step}.ckpt"), {"step": step}, keep=2)
    state = {"step": 0}
    path = fabric.load_latest(directory, state)
    return os.path.basename(path), state["step"]


def test_keep_keeps_this_runs_newest_and_never_touches_other_files(pool2, tmp_path):
    directory = tmp_path / "ckpts"
    directory.mkdir()
    (directory / "notes.txt").write_text("mine")
    other = {"format": "fabriclite.manifest", "version": 1, "run_id": "other",
             "checkpoints": [{"name": "other-1.ckpt", "run_id": "other", "time": 0.0}]}
    (directory / "fabriclite-manifest.json").write_text(json.dumps(other))
    (directory / "other-1.ckpt").write_bytes(b"x")
    (directory / ".step-9.ckpt.tmp-other-12-ab").write_bytes(b"x")  # another run's write in progress
    results = pool2.run(_keep_two, str(directory))
    assert results == [("step-4.ckpt", 4)] * 2
    names = sorted(os.listdir(directory))
    assert names == sorted([".fabriclite-manifest.lock", ".step-9.ckpt.tmp-other-12-ab", "fabriclite-manifest.json",
                            "notes.txt", "other-1.ckpt", "step-3.ckpt", "step-4.ckpt"])
    data = json.loads((directory / "fabriclite-manifest.json").read_text())
    assert [e["name"] for e in data["checkpoints"]] == ["other-1.ckpt", "step-3.ckpt", "step-4.ckpt"]
    assert data["run_id"] == data["checkpoints"][-1]["run_id"] != "other"


def _stray_cleanup(fabric, directory):
    rid = rendezvous.run_id()
    if fabric.global_rank == 0:
        open(os.path.join(directory, f".step-7.ckpt.tmp-{rid}-1-aa"), "wb").close()  # a write that was killed
    fabric.barrier()
    found = fabric.load_latest(directory, {})
    return found, sorted(os.listdir(directory))


def test_load_latest_returns_none_without_checkpoints_and_removes_this_runs_temporaries(pool2, tmp_path):
    (found, names), _ = pool2.run(_stray_cleanup, str(tmp_path))
    assert found is None and names == []
    assert pool2.run(_load_latest_missing, str(tmp_path / "never")) == [None, None]


def _load_latest_missing(fabric, directory):
    return fabric.load_latest(directory, {"x": 1})


def _bad_manifest(fabric, directory):
    errors = []
    for call in (lambda: fabric.load_latest(directory, {}),
                 lambda: fabric.save(os.path.join(directory, "a.ckpt"), {"x": 1}, keep=1)):
        try:
            call()
        except ValueError as err:
            errors.append(str(err))
    return errors, os.path.exists(os.path.join(directory, "a.ckpt"))


def test_a_foreign_manifest_is_an_error_on_every_rank_before_anything_is_written(pool2, tmp_path):
    (tmp_path / "fabriclite-manifest.json").write_text('{"something": "else"}')
    for errors, written in pool2.run(_bad_manifest, str(tmp_path)):
        assert len(errors) == 2 and all("is not a fabriclite manifest" in e for e in errors), errors
        assert not written


def test_bad_keep_and_a_file_for_a_directory_are_clear_errors(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1)
    with pytest.raises(ValueError, match="keep=0"):
        fabric.save(tmp_path / "a.ckpt", {"x": 1}, keep=0)
    with pytest.raises(TypeError, match="keep='3'"):
        fabric.save(tmp_path / "a.ckpt", {"x": 1}, keep="3")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        fabric.load_latest(tmp_path / "file", {})
    assert os.listdir(tmp_path) == ["file"]


# ---------------------------------------------------------------------- exact resume, in process
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))

    def forward(self, x):
        return self.body(x)


class Points(Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(50, 6, generator=g), torch.randint(0, 3, (50,), generator=g)

    def __len__(self) -> int:
        return 50

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _train(fabric, directory, steps, resume, save_at=()):
    fabric.seed_everything(7, verbose=False)  # the same script, so the same seed (the samplers' too)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(Points(), batch_size=4, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "step": 0,
             "resume": fabric.resume_state()}
    if resume:
        torch.manual_seed(99)  # whatever the generators hold now, load_latest must put them back
        random.seed(99)
        assert fabric.load_latest(directory, state) is not None
    step = state["step"]
    while step < steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            scheduler.step()
            step += 1
            if step in save_at:
                state["step"] = step
                fabric.save(os.path.join(directory, f"step-{step}.ckpt"), state, keep=2)
            if step >= steps:
                break
    return [p.detach().clone() for p in model.parameters()]


def _uninterrupted_then_resumed(fabric, directory):
    reference = _train(fabric, directory, 23, resume=False, save_at=(5, 17))  # 7 batches an epoch: 17 is mid-epoch
    resumed = _train(fabric, directory, 23, resume=True)
    return all(torch.equal(a, b) for a, b in zip(reference, resumed))


def test_a_mid_epoch_checkpoint_resumes_bit_for_bit(pool2, tmp_path):
    assert pool2.run(_uninterrupted_then_resumed, str(tmp_path)) == [True, True]


def _resume_state_warnings(fabric):
    import warnings

    from fabriclite.checkpoint.resume_state import NOT_EXACT_ON_3_RANKS, ResumeState
    from fabriclite.strategies import create_strategy

    exact = create_strategy("ddp_find_unused_parameters_true")
    exact.cluster_environment = fabric.strategy.cluster_environment
    with warnings.catch_warnings(record=True) as plain_caught:
        warnings.simplefilter("always")
        fabric.resume_state()
    with warnings.catch_warnings(record=True) as exact_caught:
        warnings.simplefilter("always")
        ResumeState(exact)
    plain = [str(w.message) for w in plain_caught if str(w.message) == NOT_EXACT_ON_3_RANKS]
    return fabric.strategy.name, len(plain), len([w for w in exact_caught if "bit-exact" in str(w.message)])


def test_resume_state_warns_that_plain_ddp_on_3_ranks_is_not_bit_exact(pool3, pool2):
    # rank 0 of a 3-rank ddp job warns once, naming the fix; the other ranks, ddp_find_unused_parameters_true and
    # 2 ranks (a sum of two is the same in either order) do not
    assert pool3.run(_resume_state_warnings) == [("ddp", 1, 0), ("ddp", 0, 0), ("ddp", 0, 0)]
    assert pool2.run(_resume_state_warnings) == [("ddp", 0, 0), ("ddp", 0, 0)]
