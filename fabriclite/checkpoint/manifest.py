"""Checkpoints a run keeps, and the newest one to resume from: ``save(..., keep=K)`` and ``load_latest``.

Each directory that ``fabric.save(path, state, keep=K)`` writes into holds a small manifest,
``fabriclite-manifest.json``, written atomically (temporary file, fsync, rename) by global rank 0 under a lock:

    {"format": "fabriclite.manifest", "version": 1, "run_id": "<the last writer's run id>",
     "checkpoints": [{"name": "step-5.ckpt", "run_id": "...", "time": 1700000000.0}, ...]}   # oldest first

A checkpoint is recorded only once it is complete (after ``saving.save_checkpoint`` returned on every rank), so the
newest entry is always loadable. After recording, only the ``keep`` newest entries *of this run* stay; the
dropped ones are deleted. Cleanup deletes nothing but this run's dropped checkpoints (files or sharded
directories) and this run's stray temporary files (``.<name>.tmp-<run id>-...``, left by a process killed while
writing): two jobs sharing a directory never delete each other's files.

The run id persists across restart rounds: ``$FABRICLITE_RUN_ID`` (the supervisor sets it for its ranks; set
it yourself to continue a run's cleanup in a new launch), else the SLURM job (``$SLURM_ARRAY_JOB_ID_$SLURM_
ARRAY_TASK_ID`` or ``$SLURM_JOB_ID``, so a requeued job keeps it), else torchrun's ``$TORCHELASTIC_RUN_ID``, else
one made up for this process.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from fabriclite import collectives
from fabriclite.checkpoint.atomic import swap_in, tmp_name
from fabriclite.checkpoint.saving import save_checkpoint
from fabriclite.distributed import rendezvous

MANIFEST = "fabriclite-manifest.json"
FORMAT = "fabriclite.manifest"
VERSION = 1
PathLike = Union[str, "os.PathLike[str]"]


def check_keep(keep: Any) -> int:
    """``keep`` as an int >= 1; TypeError / ValueError naming it otherwise."""
    if isinstance(keep, bool) or not isinstance(keep, int):
        raise TypeError(f"save(..., keep={keep!r}): expected an int >= 1 (how many of this run's checkpoints to keep).")
    if keep < 1:
        raise ValueError(f"save(..., keep={keep}): keep must be >= 1 (keep=0 would delete the checkpoint just "
                         "written); leave keep out to keep every checkpoint.")
    return keep


def save_recorded(strategy: Any, path: PathLike, state: Mapping[str, Any], filter: Any, keep: int) -> None:
    """``save_checkpoint`` to ``path``, then record it in its directory's manifest and keep only this run's
    ``keep`` newest (see the module docstring). Call on every rank. The manifest is checked before anything is
    written: one that is not in this format is a ValueError on every rank."""
    keep = check_keep(keep)
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    if name == MANIFEST:
        raise ValueError(f"save({path!r}): {MANIFEST} is the manifest's own name; pick another file name.")
    rid = rendezvous.run_id()
    on_rank_zero(strategy, lambda: read_manifest(directory) and None)
    save_checkpoint(strategy, path, state, filter, tmp_tag=rid)
    with collectives.rank_zero_first(strategy):
        if strategy.is_global_zero:
            record(directory, name, rid, keep)


def record(directory: str, name: str, rid: str, keep: int) -> List[str]:
    """Add ``name`` (complete) as the newest checkpoint of run ``rid`` to ``directory``'s manifest, drop this
    run's entries beyond the ``keep`` newest and delete them and this run's stray temporaries. Returns the
    names deleted. One process at a time per directory (a lock file)."""
    with _Lock(directory):
        manifest = read_manifest(directory) or _empty()
        entries = [e for e in manifest["checkpoints"] if e["name"] != name]
        entries.append({"name": name, "run_id": rid, "time": time.time()})
        mine = [e for e in entries if e["run_id"] == rid]
        dropped = mine[:-keep]
        kept = [e for e in entries if e not in dropped]
        write_manifest(directory, {**manifest, "run_id": rid, "checkpoints": kept}, rid)
    deleted = []
    for entry in dropped:
        if _delete(os.path.join(directory, entry["name"])):
            deleted.append(entry["name"])
    remove_stray_temporaries(directory, rid)
    return deleted


def latest(strategy: Any, directory: PathLike) -> Optional[str]:
    """The path of the newest checkpoint ``directory``'s manifest records whose file exists (None when there is
    none, or no directory), the same on every rank (rank 0 reads, then broadcasts). Raises ValueError, on every
    rank, when ``directory`` is a file or its manifest is not in this format. Rank 0 deletes this run's stray
    temporaries there."""
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"load_latest({directory!r}): that is a file, not a directory; pass the directory that "
                         "fabric.save(..., keep=K) writes its checkpoints into.")
    def newest() -> Optional[str]:
        path = _newest(directory)
        remove_stray_temporaries(directory, rendezvous.run_id())
        return path

    return on_rank_zero(strategy, newest)


def on_rank_zero(strategy: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` run on global rank 0, its result broadcast to every rank; a ValueError it raises is raised on
    every rank (the same message)."""
    answer: Any = None
    if strategy.is_global_zero:
        try:
            answer = ("ok", fn())
        except ValueError as err:
            answer = ("error", str(err))
    if strategy.world_size > 1:
        answer = collectives.broadcast(strategy, answer, src=0)
    if answer[0] == "error":
        raise ValueError(answer[1])
    return answer[1]


def _newest(directory: str) -> Optional[str]:
    manifest = read_manifest(directory)
    for entry in reversed(manifest["checkpoints"] if manifest else []):
        path = os.path.join(directory, entry["name"])
        if os.path.exists(path):
            return path
    return None


def read_manifest(directory: str) -> Optional[Dict[str, Any]]:
    """``directory``'s manifest, or None when it has none; ValueError naming the file when it is not one."""
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise ValueError(f"{directory!r} is a file, not a directory; checkpoints with keep= need a directory.") \
            from None
    try:
        data = json.loads(text)
        ok = data.get("format") == FORMAT and isinstance(data.get("checkpoints"), list) and all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("run_id"), str)
            and os.path.basename(e["name"]) == e["name"] for e in data["checkpoints"])
    except (ValueError, AttributeError):
        ok = False
    if not ok:
        raise ValueError(f"{path} is not a fabriclite manifest (expected JSON with format={FORMAT!r} and a list of "
                         "checkpoints). Move that file away, or save into another directory.")
    if int(data.get("version", 0)) > VERSION:
        raise ValueError(f"{path} has manifest version {data.get('version')}, newer than this fabriclite "
                         f"understands ({VERSION}); upgrade fabriclite.")
    return data


def write_manifest(directory: str, manifest: Dict[str, Any], rid: str) -> None:
    """Replace ``directory``'s manifest atomically (its temporary name carries ``rid``)."""
    os.makedirs(directory, exist_ok=True)
    tmp = tmp_name(directory, MANIFEST, rid, f"{os.getpid()}-{secrets.token_hex(4)}")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    swap_in(tmp, os.path.join(directory, MANIFEST))


def remove_stray_temporaries(directory: str, rid: str) -> None:
    """Delete ``.<name>.tmp-<rid>-...`` files in ``directory`` (only run ``rid``'s)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    marker = f".tmp-{rid}-"
    for name in names:
        if name.startswith(".") and marker in name:
            _delete(os.path.join(directory, name))


def _delete(path: str) -> bool:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _empty() -> Dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "run_id": "", "checkpoints": []}


class _Lock:
    """An exclusive flock on ``<directory>/.fabriclite-manifest.lock`` (one manifest writer at a time)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, ".fabriclite-manifest.lock")
        self.fd = -1

    def __enter__(self) -> "_Lock":
        import fcntl

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        os.close(self.fd)  # releases the lock


__all__ = ["MANIFEST", "check_keep", "latest", "read_manifest", "record", "save_recorded"]
