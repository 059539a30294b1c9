"""Checkpoint durability on real ranks and real filesystems:

- a full disk: a file-size limit (any user) and a small tmpfs (root) fail the save with an error naming the path
  and the cause, on every rank; the previous checkpoint is intact and still the latest; no temporary is left; an
  asynchronous save's failure is raised by the next save, or at the job's end as a non-zero exit;
- two jobs writing into one directory at once: the manifest's lock loses no entry and each job's ``keep=`` deletes
  only its own files;
- ``file://`` URLs on 2 ranks (ddp and fsdp);
- a mid-epoch loader state saved by 2 ranks and loaded by 3: the rest of the epoch dealt over 3 ranks, one
  warning (rank 0) naming both global batch sizes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torch import nn

from fabriclite import Fabric
from fabriclite.data.elastic_dealing import epoch_order
from fabriclite.strategies import FSDPStrategy
from helpers import python, write_script


def _model(seed: int, width: int = 12) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 6))


def _sharded(fabric, async_save: bool = False) -> Fabric:
    """An fsdp Fabric on the pool's ranks (each Linear sharded on its own)."""
    fsdp = Fabric(accelerator="cpu", devices=fabric.world_size,
                  strategy=FSDPStrategy(auto_wrap_policy={nn.Linear}, async_save=async_save))
    fsdp.launch()
    return fsdp


def _step(fabric, model, opt) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(fabric.global_rank))
    opt.zero_grad()
    fabric.backward(model(x).pow(2).mean())
    opt.step()


def _full(fabric, model):
    return {k: v.clone() for k, v in fabric.strategy.get_module_state_dict(model._forward_module).items()}

# ---------------------------------------------------------------------- a full disk
DISK_FULL = """
    import os, resource, signal, sys
    import torch
    from torch import nn
    from fabriclite import Fabric
    from fabriclite.plugins.io import AsyncCheckpointIO

    ckpt, mode = sys.argv[1], sys.argv[2]
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AsyncCheckpointIO()] if mode != "sync" else None)
    fabric.launch()
    model = fabric.setup(nn.Linear(256, 256))  # 257 KiB of weights
    fabric.save(f"{ckpt}/small.ckpt", {"step": 1}, keep=3)
    fabric.strategy.wait_for_checkpoints()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of a core dump
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))  # as if the disk were full at 64 KiB
    try:
        fabric.save(f"{ckpt}/big.ckpt", {"model": model, "step": 2}, keep=3)
        if mode == "async":
            fabric.save(f"{ckpt}/next.ckpt", {"step": 3}, keep=3)  # raises the background write's error
    except Exception as err:
        print("ERROR", type(err).__name__, err, flush=True)
    if mode != "async_end":
        print("LATEST", fabric.load_latest(ckpt, {"step": -1}), flush=True)
"""


@pytest.mark.parametrize("mode", ["sync", "async", "async_end"])
def test_a_file_size_limit_fails_the_save_naming_path_and_cause_and_keeps_the_previous_one(tmp_path, mode):
    script = write_script(tmp_path, DISK_FULL)
    ckpt = tmp_path / "ckpt"
    done = python(script, str(ckpt), mode, timeout=180)
    big = ckpt / "big.ckpt"
    if mode == "async_end":  # the failure surfaces at the end of the job: a traceback and exit code 1
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert f"AsyncSaveError: The asynchronous save of {big} failed: OSError: [Errno 27] Saving the checkpoint " \
               f"{big} failed: File too large" in done.stderr, done.stderr
    else:
        assert done.returncode == 0, done.stderr
        error = "AsyncSaveError The asynchronous save of " + str(big) + " failed: OSError: " if mode == "async" \
            else "OSError "
        assert f"ERROR {error}[Errno 27] Saving the checkpoint {big} failed: File too large; the previous file at " \
               "that path (if any) is intact and no temporary file is left." in done.stdout, done.stdout
        assert f"LATEST {ckpt / 'small.ckpt'}" in done.stdout
    assert sorted(os.listdir(ckpt)) == [".fabriclite-manifest.lock", "fabriclite-manifest.json", "small.ckpt"]


def _mount_tmpfs(where: Path, size: int) -> None:
    where.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                            text=True)
    if result.returncode != 0:
        pytest.skip(f"a small tmpfs needs root (mount failed: {result.stderr.strip()}); the file-size limit test "
                    "covers a full disk without it")


def _fill_sharded(fabric, root: str, async_save: bool):
    fsdp = _sharded(fabric, async_save)
    model = _model(0, width=96)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fsdp.setup(model, opt)
    _step(fsdp, model, opt)
    state = {"model": model, "optimizer": opt, "step": 1}
    fsdp.save(os.path.join(root, "first"), state, keep=3)  # fits
    at_first = _full(fsdp, model)
    _step(fsdp, model, opt)
    error = ""
    try:
        fsdp.save(os.path.join(root, "second"), {**state, "step": 2}, keep=3)  # does not fit beside it
        fsdp.strategy.wait_for_checkpoints()  # an asynchronous save's error is raised here
    except Exception as err:  # noqa: BLE001 - compared by the test
        error = f"{type(err).__name__}: {err}"
    state = {"model": model, "optimizer": opt, "step": -1}
    latest = fsdp.load_latest(root, state)
    loaded = _full(fsdp, model)
    same = fsdp.global_rank != 0 or all(torch.equal(at_first[k], loaded[k]) for k in at_first)
    return error, latest, state["step"], same, sorted(os.listdir(root))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_tmpfs_fails_a_sharded_save_on_every_rank_and_keeps_the_previous_one(pool2, tmp_path, async_save):
    probe = tmp_path / "probe"
    pool2.run(_fill_sharded, str(probe), False)  # how big one checkpoint is, on an ordinary disk
    size = sum(f.stat().st_size for f in (probe / "first").iterdir())
    full = tmp_path / "full"
    _mount_tmpfs(full, (size * 3 // 2 + 4095) // 4096 * 4096)  # room for one checkpoint and a half
    try:
        results = pool2.run(_fill_sharded, str(full), async_save)
    finally:
        # lazy: detached even while a pool rank still holds a file there open, so no test run leaves it mounted
        subprocess.run(["umount", "--lazy", str(full)], check=True)
    for error, latest, step, same, names in results:
        assert "second" in error and "No space left on device" in error, error
        assert latest == str(full / "first") and step == 1 and same
        assert names == [".fabriclite-manifest.lock", "fabriclite-manifest.json", "first"]  # no temporary left


# ---------------------------------------------------------------------- two writers, one directory
TWO_WRITERS = """
    import json, os, sys, time
    import torch
    from fabriclite import Fabric

    directory, go, saves = sys.argv[1], sys.argv[2], int(sys.argv[3])
    fabric = Fabric(accelerator="cpu", devices=1)
    tensor = torch.full((4096,), float(len(os.environ["FABRICLITE_RUN_ID"])))
    print("READY", flush=True)
    while not os.path.exists(go):  # both jobs start their saves together
        time.sleep(0.001)
    started = time.time()
    for i in range(saves):
        fabric.save(f"{directory}/{os.environ['FABRICLITE_RUN_ID']}-{i:02d}.ckpt", {"x": tensor, "i": i}, keep=2)
    print("WINDOW", json.dumps([started, time.time()]), flush=True)
"""


def test_two_jobs_saving_into_one_directory_lose_no_entry_and_delete_only_their_own_files(tmp_path):
    script = write_script(tmp_path, TWO_WRITERS)
    directory, go, saves = tmp_path / "shared", tmp_path / "go", 25
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = {rid: subprocess.Popen([sys.executable, str(script), str(directory), str(go), str(saves)],
                                   env={**env, "FABRICLITE_RUN_ID": rid}, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for rid in ("jobA", "jobBB")}
    for proc in procs.values():  # both imported torch and made their Fabric
        assert proc.stdout is not None and proc.stdout.readline() == "READY\n"
    go.touch()
    windows = {}
    for rid, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        windows[rid] = json.loads(out.split("WINDOW ", 1)[1])
    (a_start, a_end), (b_start, b_end) = windows["jobA"], windows["jobBB"]
    assert a_start < b_end and b_start < a_end, windows  # the two jobs really saved at the same time
    entries = json.loads((directory / "fabriclite-manifest.json").read_text())["checkpoints"]
    expected = {f"{rid}-{i:02d}.ckpt" for rid in ("jobA", "jobBB") for i in (saves - 2, saves - 1)}
    assert {e["name"] for e in entries} == expected and len(entries) == 4  # no entry lost, none duplicated
    assert sorted(os.listdir(directory)) == sorted([".fabriclite-manifest.lock", "fabriclite-manifest.json",
                                                     *expected])  # each job deleted its own, and only those
    for entry in entries:
        assert torch.load(directory / entry["name"], weights_only=True)["i"] == int(entry["name"][-7:-5])


# ---------------------------------------------------------------------- file:// URLs on real ranks
def _file_urls(fabric, root: str):
    url = f"file://{root}"
    model = fabric.setup(_model(0))
    for step in range(3):
        fabric.save(f"{url}/ddp/s{step}.ckpt", {"model": model, "step": step}, keep=2)
    state = {"model": model, "step": -1}
    ddp = (fabric.load_latest(f"{url}/ddp", state), state["step"], sorted(os.listdir(os.path.join(root, "ddp"))))
    fsdp = _sharded(fabric)
    sharded = fsdp.setup(_model(1))
    for step in range(2):
        fsdp.save(f"{url}/fsdp/s{step}", {"model": sharded, "step": step}, keep=1)
    state = {"model": sharded, "step": -1}
    return ddp, (fsdp.load_latest(f"{url}/fsdp", state), state["step"], sorted(os.listdir(os.path.join(root, "fsdp"))))


def test_file_urls_save_load_and_keep_on_two_ranks(pool2, tmp_path):
    for ddp, fsdp in pool2.run(_file_urls, str(tmp_path)):
        assert ddp == (str(tmp_path / "ddp" / "s2.ckpt"), 2, [".fabriclite-manifest.lock", "fabriclite-manifest.json",
                                                               "s1.ckpt", "s2.ckpt"])
        assert fsdp == (str(tmp_path / "fsdp" / "s1"), 1, [".fabriclite-manifest.lock", "fabriclite-manifest.json",
                                                            "s1"])


# ---------------------------------------------------------------------- a loader position at another world size
def _save_mid_epoch(fabric, path: str):
    from torch.utils.data import DataLoader

    loader = fabric.setup_dataloaders(DataLoader(list(range(48)), batch_size=4, shuffle=True))
    iterator = iter(loader)
    next(iterator), next(iterator)
    fabric.save(path, {"loader": loader})
    return loader.state_dict()


def _load_elsewhere(fabric, path: str):
    import warnings

    from torch.utils.data import DataLoader

    loader = fabric.setup_dataloaders(DataLoader(list(range(48)), batch_size=4, shuffle=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(path, {"loader": loader})
    samples = [i for b in loader for i in b.tolist()]
    return [str(w.message) for w in caught if "Elastic resume" in str(w.message)], samples


def test_a_mid_epoch_loader_state_from_two_ranks_continues_on_three(pool2, pool3, tmp_path):
    path = str(tmp_path / "loader.ckpt")
    saved = pool2.run(_save_mid_epoch, path)
    seed = saved[0]["seed"]
    assert saved[0] == {"epoch": 0, "batch": 2, "world_size": 2, "batch_size": 4, "dataset_length": 48,
                        "seed": seed, "shuffle": True, "start": 0, "samples": 16}
    loaded = pool3.run(_load_elsewhere, path)
    (message,) = loaded[0][0]
    assert loaded[1][0] == loaded[2][0] == []
    assert "saved by 2 ranks and this run has 3: epoch 0 continues after the first 16 of its 48 samples" in message
    assert "from 8 (4 x 2 ranks) to 12 (4 x 3 ranks)" in message
    assert "1 repeated as padding" in message  # the 32 left, padded to 33 for 3 ranks
    rest = [i for _, samples in loaded for i in samples]
    assert len(rest) == 33 and set(rest) == set(epoch_order(48, 0, seed, True)[16:])


# ---------------------------------------------------------------------- a damaged sharded checkpoint
def _damaged_shards(fabric, root: str):
    import warnings

    fsdp = _sharded(fabric)
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fsdp.setup(model, opt)
    weights = []
    for step in range(3):
        _step(fsdp, model, opt)
        fsdp.save(os.path.join(root, f"s{step}"), {"model": model, "optimizer": opt, "step": step}, keep=3)
        weights.append(_full(fsdp, model))
    if fsdp.global_rank == 0:
        os.remove(os.path.join(root, "s2", "__1_0.distcp"))  # rank 1's shard of the newest is gone
        with open(os.path.join(root, "s1", "__0_0.distcp"), "r+b") as f:  # rank 0's shard of the next: a bit flipped
            f.seek(os.path.getsize(f.name) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    fsdp.barrier()
    state = {"model": model, "optimizer": opt, "step": -1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = fsdp.load_latest(root, state)
    loaded = _full(fsdp, model)
    same = fsdp.global_rank != 0 or all(torch.equal(weights[0][k], loaded[k]) for k in loaded)
    return latest, state["step"], same, [str(w.message) for w in caught if "load_latest" in str(w.message)]


def test_a_missing_shard_and_a_flipped_bit_fall_back_to_the_newest_sharded_checkpoint_that_checks_out(pool2, tmp_path):
    results = pool2.run(_damaged_shards, str(tmp_path))
    for rank, (latest, step, same, warned) in enumerate(results):
        assert latest == str(tmp_path / "s0") and step == 0 and same
        if rank == 0:  # warnings come from global rank 0
            assert len(warned) == 2, warned
            assert "s2: s2/__1_0.distcp is missing" in warned[0]
            assert "s1: s1/__0_0.distcp does not hold the bytes that were written" in warned[1]
        else:
            assert warned == []


# ---------------------------------------------------------------------- the sharded snapshot
def _slow_sharded_async_save(fabric, root: str):
    from torch.distributed.checkpoint import filesystem

    fsdp = _sharded(fabric, async_save=True)
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = fsdp.setup(model, opt)
    _step(fsdp, model, opt)
    at_save = _full(fsdp, model)
    real_write = filesystem._write_item
    started = []

    def slow_write(*args, **kwargs):  # the background write takes a while: the loop runs on meanwhile
        started.append(time.monotonic())
        time.sleep(0.3)
        return real_write(*args, **kwargs)

    filesystem._write_item = slow_write
    try:
        before = time.monotonic()
        fsdp.save(os.path.join(root, "ckpt"), {"model": model, "optimizer": opt, "step": 1})
        returned = time.monotonic()
        _step(fsdp, model, opt)  # later optimizer steps change the live (sharded) tensors in place
        stepped = time.monotonic()
        _step(fsdp, model, opt)
        _step(fsdp, model, opt)
        fsdp.strategy.wait_for_checkpoints()
    finally:
        filesystem._write_item = real_write
    fresh = _model(5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh, fresh_opt = fsdp.setup(fresh, fresh_opt)
    fsdp.load(os.path.join(root, "ckpt"), {"model": fresh, "optimizer": fresh_opt})
    loaded = _full(fsdp, fresh)
    return (fsdp.global_rank != 0 or all(torch.equal(at_save[k], loaded[k]) for k in loaded),
            returned - before, len(started), started[-1] > stepped if started else None)


def test_a_sharded_async_save_holds_the_state_it_was_given_while_training_goes_on(pool2, tmp_path):
    for same, save_call_s, writes, last_write_after_the_steps in pool2.run(_slow_sharded_async_save, str(tmp_path)):
        assert same  # the three later optimizer steps did not leak into the checkpoint
        assert writes >= 2 and last_write_after_the_steps  # the write went on after a step changed the tensors
