"""Checkpoints that run no code (issue 42, part 4), with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` set: a planted
``.ckpt``, ``meta.pt`` and DCP folder (its ``.metadata``, its byte items) raise through ``fabric.load``,
``load_latest``, ``load_raw`` and ``fabriclite consolidate`` and their code never runs (no marker file); only an
explicit ``weights_only=False`` / ``--trusted`` runs it. fabriclite's own stored items (loader and stream
positions, every rank's RNG states) load with ``weights_only=True``."""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from helpers import REPO

FORCE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


class Planted:
    """Creates the file ``marker`` when a pickle holding it is loaded without restriction."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _sharded_folder(path: str, planted_in: str, marker: str) -> str:
    """A sharded checkpoint folder (DCP files + meta.pt) whose ``planted_in`` part ("meta", "metadata" or
    "bytes") holds a Planted object; written by this one process."""
    import torch.distributed.checkpoint as dcp

    shutil.rmtree(path, ignore_errors=True)
    state = {"model": {"weight": torch.ones(1, 2)}}
    if planted_in == "bytes":
        state["extra"] = Planted(marker)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "torch.distributed is ... uninitialized, assuming ... a single process"
        dcp.save(state, checkpoint_id=path, no_dist=True)
    torch.save({"step": Planted(marker) if planted_in == "meta" else 1}, os.path.join(path, "meta.pt"))
    if planted_in == "metadata":
        with open(os.path.join(path, ".metadata"), "wb") as f:
            pickle.dump(Planted(marker), f)
    return path


def _outcome(fn):
    try:
        fn()
        return "loaded"
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException: it must not pass
        return f"{type(err).__name__}: {err}"


def _planted_loads(fabric, directory: str, folders: dict):
    rank = fabric.global_rank
    os.environ[FORCE] = "1"
    try:
        marker = os.path.join(directory, "from-ckpt")
        ckpt = os.path.join(directory, "planted.ckpt")
        recorded = os.path.join(directory, "recorded")
        fabric.save(ckpt, {"weight": torch.ones(2), "extra": Planted(marker)})
        fabric.save(os.path.join(recorded, "step-1.ckpt"), {"weight": torch.ones(2), "extra": Planted(marker)}, keep=2)
        out = {
            "load": _outcome(lambda: fabric.load(ckpt)),
            "load_state": _outcome(lambda: fabric.load(ckpt, {"weight": None})),
            "load_raw": _outcome(lambda: fabric.load_raw(ckpt, torch.nn.Linear(2, 1))),
            "load_latest": _outcome(lambda: fabric.load_latest(recorded, {"weight": None})),
            "load_true": _outcome(lambda: fabric.load(ckpt, weights_only=True)),
        }
        for name, path in folders.items():
            out[f"{name}: load"] = _outcome(lambda: fabric.load(path))
            if name != "bytes":  # a module's keys only: the planted byte item is not among them
                model = torch.nn.Linear(2, 1, bias=False)
                out[f"{name}: load model"] = _outcome(lambda: fabric.load(path, {"model": model}, strict=False))
        fabric.barrier()
        out["markers"] = sorted(f for f in os.listdir(directory) if f.startswith("from-"))
        fabric.barrier()
        if rank == 0:  # the control: the caller's own False runs it
            out["trusted"] = _outcome(lambda: fabric.strategy.checkpoint_io.load_checkpoint(ckpt, weights_only=False))
        return out
    finally:
        del os.environ[FORCE]


def test_planted_checkpoints_raise_and_run_nothing(pool2, tmp_path):
    folders = {name: _sharded_folder(str(tmp_path / f"{name}.ckpt"), name, str(tmp_path / f"from-{name}"))
               for name in ("meta", "metadata", "bytes")}
    results = pool2.run(_planted_loads, str(tmp_path), folders)
    for rank, out in enumerate(results):
        assert out.pop("markers") == [], f"rank {rank}: a planted object's code ran"
        trusted = out.pop("trusted", None)
        assert trusted == ("loaded" if rank == 0 else None), (rank, trusted)
        for call, outcome in out.items():
            assert "UnpicklingError" in outcome, (rank, call, outcome)
            assert "exec" in outcome, (rank, call, outcome)  # names what it refused
    assert os.path.exists(tmp_path / "from-ckpt"), "the control did not run the planted code: the test proves nothing"


def test_consolidate_refuses_planted_folders_unless_trusted(tmp_path):
    env = {**os.environ, FORCE: "1", "PYTHONPATH": str(REPO)}
    for name in ("meta", "metadata", "bytes"):
        folder = _sharded_folder(str(tmp_path / f"{name}.ckpt"), name, str(tmp_path / f"from-{name}"))
        done = subprocess.run([sys.executable, "-m", "fabriclite", "consolidate", folder], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, (name, done.stderr)
        assert "fabriclite consolidate: error: nothing was written" in done.stderr and "--trusted" in done.stderr
        assert not os.path.exists(folder + ".consolidated") and not os.path.exists(tmp_path / f"from-{name}"), name
    trusted = subprocess.run([sys.executable, "-m", "fabriclite", "consolidate", str(tmp_path / "meta.ckpt"),
                              "--trusted"], env=env, capture_output=True, text=True, timeout=120)
    assert trusted.returncode == 0, trusted.stderr
    assert os.path.exists(tmp_path / "from-meta"), "--trusted loads as torch.load(weights_only=False) does"


def _own_items(fabric, kind: str, directory: str, workers: int):
    import stream_data

    stream_data.allow_workers()
    rank, world = fabric.global_rank, fabric.world_size
    loader = fabric.setup_dataloaders(stream_data.make_loader(kind, 48, 2, workers, rank, world))
    for step, _ in enumerate(loader, 1):
        if step == 3:
            break
    state = {"loader": loader, "resume": fabric.resume_state(), "step": 3}
    fabric.save(os.path.join(directory, "step-3.ckpt"), state, keep=2)
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(os.path.join(directory, "step-3.ckpt"))
    os.environ[FORCE] = "1"
    try:
        fresh = fabric.setup_dataloaders(stream_data.make_loader(kind, 48, 2, workers, rank, world))
        restored = {"loader": fresh, "resume": fabric.resume_state(), "step": 0}
        fabric.load_latest(directory, restored)
    finally:
        del os.environ[FORCE]
    return unsafe, restored["step"]


@pytest.mark.parametrize("kind, workers", [("map", 0), ("stateful", 2), ("torchdata", 0), ("hf", 1)])
def test_fabriclites_own_items_load_with_weights_only(pool2, tmp_path, kind, workers):
    if kind == "torchdata":
        pytest.importorskip("torchdata")
    if kind == "hf":
        pytest.importorskip("datasets")
    for unsafe, step in pool2.run(_own_items, kind, str(tmp_path), workers):
        assert unsafe == [] and step == 3, (kind, unsafe, step)
