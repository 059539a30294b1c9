"""Lineages, pruning and dead writers (fabriclite.checkpoint.lineage, .writers), in one process with real files and
real child processes as the other writers:

- ``prune`` (hypothesis): the K newest of the lineage stay, and the newest of each other live writer; other
  lineages are never touched;
- ``keep=K`` counts across a lineage that new run ids continue after loading, and never across unrelated runs;
  two branches of one lineage (a child process as the other) never delete a live one's newest checkpoint;
- a writer is dead when its process is gone, when its pid now belongs to a process that started at another time,
  and (another host) when its lock file is gone or unlocked; alive while a process holds the lock;
- the next save removes what a dead writer left (temporaries, a checkpoint published but never recorded, its
  pending entry and lock file) and nothing of a live writer's; on an fsspec ``memory://`` URL too.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fabriclite import Fabric
from fabriclite.checkpoint import lineage, manifest, writers

MANIFEST = "fabriclite-manifest.json"


def _entries(directory: Path) -> List[Dict[str, Any]]:
    return json.loads((directory / MANIFEST).read_text())["checkpoints"]


def _child(code: str = "import time; time.sleep(60)") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def _dead_writer() -> writers.Writer:
    """The identity of a process that ran on this host and has ended."""
    proc = _child("pass")
    writer = {"host": writers.host(), "pid": proc.pid, "start": writers.start_ticks(proc.pid) or 1}
    proc.wait()
    return writer


# ---------------------------------------------------------------------- prune, as a function
WRITERS = [{"host": "h", "pid": p, "start": 1} for p in range(4)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("AB"), st.integers(0, 3)), min_size=1, max_size=14),
       st.integers(1, 4), st.sets(st.integers(0, 3)), st.integers(0, 3))
def test_prune_keeps_the_lineages_newest_and_each_live_writers_newest(made, keep, alive, me):
    entries = [{"name": f"c{i}", "run_id": "r", "lineage": lin, "writer": WRITERS[w]} for i, (lin, w) in
               enumerate(made)]
    kept, dropped = lineage.prune(entries, "A", keep, WRITERS[me], lambda w: w["pid"] in alive)
    ours = [e for e in entries if e["lineage"] == "A"]
    assert [e for e in entries if e["lineage"] == "B"] == [e for e in kept if e["lineage"] == "B"]
    assert all(e["lineage"] == "A" for e in dropped) and len(kept) + len(dropped) == len(entries)
    assert all(e in kept for e in ours[-keep:])  # the K newest of the lineage
    for w in alive - {me}:
        theirs = [e for e in ours if e["writer"] == WRITERS[w]]
        assert not theirs or theirs[-1] in kept  # a live branch's newest
    assert len([e for e in kept if e["lineage"] == "A"]) <= keep + len(alive - {me})


def test_a_run_continues_the_lineage_it_loaded_else_its_own_else_a_new_one():
    entries = [{"name": "a", "run_id": "r1", "lineage": "L1"}, {"name": "b", "run_id": "r2"}]
    assert lineage.choose("L0", entries, "r1") == "L0"
    assert lineage.choose(None, entries, "r1") == "L1"
    assert lineage.choose(None, entries, "r2") == "r2"  # an entry from before lineages: its run id
    assert lineage.choose(None, entries, "r3") == "r3"


# ---------------------------------------------------------------------- keep=K across run ids
def _save(fabric: Fabric, directory: Path, name: str, step: int, keep: int = 2) -> None:
    fabric.save(directory / name, {"step": step, "w": torch.full((3,), float(step))}, keep=keep)


def test_keep_counts_across_relaunches_that_resumed_and_never_across_unrelated_runs(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    for launch in range(4):  # four launches, each a new run id, each resuming from the newest
        monkeypatch.setenv("FABRICLITE_RUN_ID", f"launch{launch}")
        fabric = Fabric(accelerator="cpu", devices=1)
        state = {"step": 0}
        loaded = fabric.load_latest(directory, state)
        assert (loaded is None) == (launch == 0)
        for step in range(state["step"] + 1, state["step"] + 3):
            _save(fabric, directory, f"step-{step}.ckpt", step)
    monkeypatch.setenv("FABRICLITE_RUN_ID", "other")  # an unrelated run: no load, its own lineage
    other = Fabric(accelerator="cpu", devices=1)
    _save(other, directory, "other-1.ckpt", 1, keep=1)
    _save(other, directory, "other-2.ckpt", 2, keep=1)
    names = [(e["name"], e["lineage"]) for e in _entries(directory)]
    assert names == [("step-7.ckpt", "launch0"), ("step-8.ckpt", "launch0"), ("other-2.ckpt", "other")]
    assert sorted(os.listdir(directory)) == [".fabriclite-manifest.lock", MANIFEST, "other-2.ckpt", "step-7.ckpt",
                                             "step-8.ckpt"]
    monkeypatch.setenv("FABRICLITE_RUN_ID", "launch4")  # a fifth launch that loads by path continues it too
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.load(directory / "step-8.ckpt", {"step": 0})
    _save(fabric, directory, "step-9.ckpt", 9)
    assert [e["name"] for e in _entries(directory)] == ["step-8.ckpt", "other-2.ckpt", "step-9.ckpt"]


# ---------------------------------------------------------------------- dead or alive
def test_a_writer_on_this_host_is_dead_once_its_process_ended_or_its_pid_started_again():
    proc = _child()
    try:
        writer = {"host": writers.host(), "pid": proc.pid, "start": writers.start_ticks(proc.pid)}
        assert not writers.is_dead(writer) and not writers.is_dead(writers.me())
        assert writers.is_dead({**writer, "start": writer["start"] + 1})  # that pid, another process
    finally:
        proc.kill()
        proc.wait()
    assert writers.is_dead(writer)
    assert writers.parse(f".step-5.ckpt.tmp-run_1-{writers.token(writer)}-0a1b2c3d") == writer


LOCK_HOLDER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
print("LOCKED", flush=True)
time.sleep(60)
"""


def test_a_writer_on_another_host_is_alive_while_its_lock_is_held(tmp_path):
    foreign = {"host": "elsewhere.example", "pid": 1234, "start": 5678}
    assert writers.is_dead(foreign, str(tmp_path))  # no lock file: not saving
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, writers.lock_path(str(tmp_path), foreign)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "LOCKED\n"
        assert not writers.is_dead(foreign, str(tmp_path))
        assert not writers.is_dead(foreign, "memory://bucket/run")  # no lock there: taken to be alive
    finally:
        holder.kill()
        holder.wait()
    assert writers.is_dead(foreign, str(tmp_path))  # killed: the kernel dropped its lock


# ---------------------------------------------------------------------- what the next save removes
def test_the_next_save_removes_a_dead_writers_leftovers_and_nothing_of_a_live_writers(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    monkeypatch.setenv("FABRICLITE_RUN_ID", "first")
    fabric = Fabric(accelerator="cpu", devices=1)
    _save(fabric, directory, "step-1.ckpt", 1)
    dead = _dead_writer()
    live_proc = _child()
    live = {"host": writers.host(), "pid": live_proc.pid, "start": writers.start_ticks(live_proc.pid)}
    try:
        found = json.loads((directory / MANIFEST).read_text())
        found["pending"] = [{"name": "step-2.ckpt", "run_id": "first", "lineage": "first", "time": 1.0,
                             "writer": dead},
                            {"name": "step-3.ckpt", "run_id": "first", "lineage": "first", "time": 2.0,
                             "writer": live},
                            {"name": "new-1.ckpt", "run_id": "gone", "lineage": "gone", "time": 3.0, "writer": dead}]
        (directory / MANIFEST).write_text(json.dumps(found))
        strays = {f".step-2.ckpt.tmp-first-{writers.token(dead)}-00000001",  # the dead writer's temporaries
                  f".other.ckpt.tmp-x-{writers.token(dead)}-00000002",
                  f".new-1.ckpt.tmp-gone-{writers.token(dead)}-00000003",
                  f"{writers.LOCK_PREFIX}{writers.token(dead)}{writers.LOCK_SUFFIX}"}
        published = {"step-2.ckpt", "new-1.ckpt"}  # published, never recorded
        kept = {f".step-3.ckpt.tmp-first-{writers.token(live)}-00000004", "unrelated.ckpt"}
        for name in strays | published | kept:
            (directory / name).write_bytes(b"x")
        fabric.load_latest(directory, {"step": 0})
        _save(fabric, directory, "step-4.ckpt", 4)
        left = set(os.listdir(directory))
        assert not (strays | published) & left, left
        assert kept <= left and {"step-1.ckpt", "step-4.ckpt"} <= left
        pending = json.loads((directory / MANIFEST).read_text())["pending"]
        assert [p["name"] for p in pending] == ["step-3.ckpt"]  # the live writer's stays pending
    finally:
        live_proc.kill()
        live_proc.wait()


def test_a_save_that_failed_leaves_its_pending_entry_to_the_next_save_of_the_same_writer(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    monkeypatch.setenv("FABRICLITE_RUN_ID", "r")
    fabric = Fabric(accelerator="cpu", devices=1)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot be saved")

    with pytest.raises(RuntimeError, match="cannot be saved"):
        fabric.save(directory / "bad.ckpt", {"x": Unpicklable()}, keep=2)
    assert [p["name"] for p in json.loads((directory / MANIFEST).read_text())["pending"]] == ["bad.ckpt"]
    assert not any(n.startswith(writers.LOCK_PREFIX) for n in os.listdir(directory))  # its lock dropped
    _save(fabric, directory, "good.ckpt", 1)
    assert json.loads((directory / MANIFEST).read_text())["pending"] == []
    assert sorted(os.listdir(directory)) == [".fabriclite-manifest.lock", MANIFEST, "good.ckpt"]
    assert manifest.read_manifest(str(directory)) is not None


def test_on_a_url_the_next_save_removes_a_checkpoint_a_dead_writer_published_but_never_recorded(monkeypatch):
    import fsspec

    root = f"memory://fabriclite-lineage-{os.getpid()}"
    monkeypatch.setenv("FABRICLITE_RUN_ID", "r")
    fabric = Fabric(accelerator="cpu", devices=1)
    fs = fsspec.filesystem("memory")
    try:
        fabric.save(f"{root}/step-1.ckpt", {"step": 1}, keep=2)
        found = manifest.read_manifest(root)
        assert found is not None and found["pending"] == []
        found["pending"] = [{"name": "step-2.ckpt", "run_id": "r", "lineage": "r", "time": 1.0,
                             "writer": _dead_writer()}]
        manifest.write_manifest(root, found, "r")
        fs.pipe_file(f"{root[len('memory://'):]}/step-2.ckpt", b"published, never recorded")
        fabric.save(f"{root}/step-3.ckpt", {"step": 3}, keep=2)
        names = sorted(os.path.basename(p) for p in fs.ls(root[len("memory://"):], detail=False))
        assert names == [MANIFEST, "step-1.ckpt", "step-3.ckpt"]
        assert manifest.read_manifest(root)["pending"] == []
    finally:
        fs.rm(root[len("memory://"):], recursive=True)


BRANCH = """
import os, sys, time
from fabriclite import Fabric
directory = sys.argv[1]
fabric = Fabric(accelerator="cpu", devices=1)
fabric.load_latest(directory, {"step": 0})
fabric.save(os.path.join(directory, "b-1.ckpt"), {"step": 1}, keep=1)
print("SAVED", flush=True)
time.sleep(120)
"""


def test_two_branches_of_one_lineage_never_delete_the_newest_checkpoint_of_a_live_one(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    monkeypatch.setenv("FABRICLITE_RUN_ID", "origin")
    _save(Fabric(accelerator="cpu", devices=1), directory, "c.ckpt", 0)
    branch = subprocess.Popen([sys.executable, "-c", BRANCH, str(directory)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "FABRICLITE_RUN_ID": "branch_b"})
    try:
        assert branch.stdout is not None and branch.stdout.readline() == "SAVED\n"
        monkeypatch.setenv("FABRICLITE_RUN_ID", "branch_a")
        fabric = Fabric(accelerator="cpu", devices=1)
        fabric.load(directory / "c.ckpt", {"step": 0})  # the checkpoint B resumed from: a second branch
        for step in (1, 2, 3):
            _save(fabric, directory, f"a-{step}.ckpt", step, keep=1)
        assert [(e["name"], e["lineage"]) for e in _entries(directory)] == [("b-1.ckpt", "origin"),
                                                                            ("a-3.ckpt", "origin")]
    finally:
        branch.kill()
        branch.wait()
    _save(fabric, directory, "a-4.ckpt", 4, keep=1)  # B has ended: its checkpoint counts like any other
    assert [e["name"] for e in _entries(directory)] == ["a-4.ckpt"]
    assert sorted(n for n in os.listdir(directory) if n.endswith(".ckpt")) == ["a-4.ckpt"]


def test_load_latest_names_unrecorded_checkpoints_but_not_a_killed_saves_pending_one(tmp_path):
    import warnings

    directory = tmp_path / "ckpt"
    directory.mkdir()
    manifest.write_manifest(str(directory), {**manifest._empty(), "pending": [
        {"name": "killed.ckpt", "run_id": "r", "lineage": "r", "time": 1.0, "writer": _dead_writer()}]}, "r")
    for name in ("killed.ckpt", "loose.ckpt"):
        torch.save({"step": 1}, directory / name)
    fabric = Fabric(accelerator="cpu", devices=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fabric.load_latest(directory, {"step": 0}) is None
    told = [str(w.message) for w in caught if "found no recorded checkpoint" in str(w.message)]
    assert len(told) == 1 and "1 checkpoint(s)" in told[0] and "loose.ckpt" in told[0], told
    assert "killed.ckpt" not in told[0]
