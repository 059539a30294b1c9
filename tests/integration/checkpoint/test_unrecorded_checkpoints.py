"""The trap of ``save`` without ``keep=`` followed by ``load_latest``: nothing is recorded, so ``load_latest``
returns None. When the folder holds what ``save`` writes (``*.ckpt``, ``*.pt``, ``*.pth`` files, sharded
folders), global rank 0 warns once, naming them and saying that ``save(..., keep=K)`` records a checkpoint; the
other ranks stay quiet. On real ranks (ddp and fsdp, a local path and a ``file://`` URL) and through fsspec's
``memory://``; a folder whose checkpoints are recorded, or that holds none, gives no warning.
"""
from __future__ import annotations

import os
import warnings
from typing import List, Tuple

from torch import nn

from fabriclite import Fabric
from fabriclite.strategies import FSDPStrategy

UNRECORDED = "found no recorded checkpoint"


def _calls(fabric: Fabric, directory: str, times: int = 2) -> Tuple[List[object], List[str]]:
    """``load_latest(directory)`` ``times`` times; what it returned and the warnings about unrecorded files."""
    results: List[object] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default: one warning per message and place
        for _ in range(times):
            results.append(fabric.load_latest(directory, {"step": -1}))
    return results, [str(w.message) for w in caught if UNRECORDED in str(w.message)]


def _unrecorded_on_ranks(fabric: Fabric, root: str):
    model = fabric.setup(nn.Linear(3, 3))
    plain = os.path.join(root, "plain")
    fabric.save(os.path.join(plain, "epoch-1.ckpt"), {"model": model, "step": 1})
    fabric.save(f"file://{plain}/weights.pt", {"model": model})
    fabric.save(os.path.join(plain, "last.pth"), {"step": 2})
    fsdp = Fabric(accelerator="cpu", devices=fabric.world_size, strategy=FSDPStrategy(auto_wrap_policy={nn.Linear}))
    fsdp.launch()
    fsdp.save(os.path.join(plain, "sharded-3"), {"model": fsdp.setup(nn.Linear(3, 3)), "step": 3})
    if fabric.global_rank == 0:  # neither a checkpoint nor named: notes, a stray temporary, an empty folder
        with open(os.path.join(plain, "notes.txt"), "w") as f:
            f.write("x")
        with open(os.path.join(plain, ".epoch-2.ckpt.tmp-run-1"), "w") as f:
            f.write("x")
        os.makedirs(os.path.join(plain, "logs"))
    fabric.barrier()
    local = _calls(fabric, plain)
    url = _calls(fsdp, f"file://{plain}", times=1)
    recorded = os.path.join(root, "recorded")
    fabric.save(os.path.join(recorded, "a.ckpt"), {"step": 5}, keep=2)
    fabric.save(os.path.join(recorded, "loose.ckpt"), {"step": 6})  # a recorded one loads: nothing to say
    state = {"step": -1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = fabric.load_latest(recorded, state)
        empty = fabric.load_latest(os.path.join(root, "missing"), {"step": -1})
    quiet = [str(w.message) for w in caught if UNRECORDED in str(w.message)]
    return local, url, (os.path.basename(loaded), state["step"], empty, quiet)


def test_rank_zero_warns_once_naming_the_unrecorded_checkpoints(pool2, tmp_path):
    results = pool2.run(_unrecorded_on_ranks, str(tmp_path))
    for rank, (local, url, recorded) in enumerate(results):
        assert local[0] == [None, None] and url[0] == [None]
        assert recorded == ("a.ckpt", 5, None, [])
        if rank > 0:
            assert local[1] == [] and url[1] == []
            continue
        assert len(local[1]) == 1 and len(url[1]) == 1, (local[1], url[1])  # once, for two calls
        for message in local[1] + url[1]:
            assert "4 checkpoint(s)" in message, message
            assert "epoch-1.ckpt, last.pth, sharded-3/, weights.pt." in message, message
            assert "save(path, state, keep=K) records a checkpoint" in message, message
            assert "notes.txt" not in message and ".tmp-" not in message and "logs" not in message
        assert f"load_latest({str(tmp_path / 'plain')!r})" in local[1][0]


def test_memory_url_warns_naming_the_files_and_stays_quiet_once_recorded():
    import fsspec

    root = f"memory://fabriclite-unrecorded-{os.getpid()}"
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    try:
        for i in range(10):
            fabric.save(f"{root}/run/step-{i}.pt", {"step": i})
        result, messages = _calls(fabric, f"{root}/run")
        assert result == [None, None] and len(messages) == 1, messages
        assert f"load_latest('{root}/run')" in messages[0]
        assert "10 checkpoint(s)" in messages[0] and "step-0.pt, step-1.pt" in messages[0]
        assert "and 2 more" in messages[0] and "keep=K" in messages[0]
        fabric.save(f"{root}/run/step-10.pt", {"step": 10}, keep=20)
        state = {"step": -1}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert fabric.load_latest(f"{root}/run", state) == f"{root}/run/step-10.pt"
        assert state["step"] == 10 and not [w for w in caught if UNRECORDED in str(w.message)]
        with warnings.catch_warnings(record=True) as caught:  # a URL with nothing there: None, no warning
            warnings.simplefilter("always")
            assert fabric.load_latest(f"{root}/none", {"step": -1}) is None
        assert not [w for w in caught if UNRECORDED in str(w.message)]
    finally:
        fsspec.filesystem("memory").rm(root[len("memory://"):], recursive=True)
