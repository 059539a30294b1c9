"""Checkpoints a run keeps, and the newest one to resume from: ``save(..., keep=K)`` and ``load_latest``.

Each directory that ``fabric.save(path, state, keep=K)`` writes into holds a small manifest,
``fabriclite-manifest.json``, written atomically (temporary file, fsync, rename) by global rank 0 under a lock:

    {"format": "fabriclite.manifest", "version": 1, "run_id": "<the last writer's run id>",
     "checkpoints": [{"name": "step-5.ckpt", "run_id": "...", "lineage": "...", "time": 1700000000.0,
                      "writer": {"host": "node1", "pid": 4242, "start": 81234},
                      "files": {"step-5.ckpt": {"size": 1234, "sha256": "..."}}}, ...],   # oldest first
     "pending": [{"name": "step-10.ckpt", "run_id": "...", "lineage": "...", "time": ..., "writer": {...}}]}

A checkpoint is recorded only once it is complete on every rank (``saving.save_checkpoint``'s ``on_complete``:
at once for a synchronous save, in the background for an asynchronous one), with the size and sha256 of each of
its files (``fabriclite.checkpoint.integrity``; ``load_latest`` checks them: ``fabriclite.checkpoint.latest``).
The manifest is the commit point. After recording, only the ``keep`` newest entries *of this lineage* stay
(``fabriclite.checkpoint.lineage``: a run that resumed from a checkpoint continues its lineage, across new run
ids); the dropped ones are deleted (one-file checkpoints through the strategy's CheckpointIO's
``remove_checkpoint``). Each save is first recorded as pending (``"pending"``: name, lineage, run id and writer,
``fabriclite.checkpoint.writers``), so the next save can delete what a killed writer left: its temporaries and a
checkpoint it published but never recorded. Cleanup deletes nothing but the lineage's dropped checkpoints, what
dead writers left, and this run's stray temporary files: a live writer's files and the checkpoints of unrelated
runs sharing the directory are never touched, and the lock serialises the manifest updates (no entry is lost).

On an fsspec URL (``fabriclite.checkpoint.remote_paths``) the manifest is one object, replaced by one upload; an
object store has no lock, so two jobs must not share a directory there (an update can overwrite the other's).

The run id persists across restart rounds: ``$FABRICLITE_RUN_ID`` (the supervisor sets it for its ranks; set
it yourself to continue a run's cleanup in a new launch), else the SLURM job (``$SLURM_ARRAY_JOB_ID_$SLURM_
ARRAY_TASK_ID`` or ``$SLURM_JOB_ID``, so a requeued job keeps it), else torchrun's ``$TORCHELASTIC_RUN_ID``, else
one made up for this process.
"""
from __future__ import annotations

import json
import os
import secrets
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from fabriclite import collectives
from fabriclite.checkpoint import lineage, remote_paths, writers
from fabriclite.checkpoint.atomic import remove_path, swap_in, tmp_name
from fabriclite.checkpoint.saving import save_checkpoint, wait_for_saves
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


def save_recorded(strategy: Any, path: PathLike, state: Mapping[str, Any], filter: Any, keep: int,
                  lineages: Optional[lineage.Lineages] = None) -> None:
    """``save_checkpoint`` to ``path``, then record it in its directory's manifest and keep only the ``keep``
    newest of its lineage (see the module docstring; ``lineages``: what this Fabric loaded, to continue its
    lineage). Call on every rank. The manifest is checked before anything is written: one that is not in this
    format is a ValueError on every rank."""
    keep = check_keep(keep)
    path = remote_paths.normalize(path)
    directory, name = remote_paths.split(path)
    if name == MANIFEST:
        raise ValueError(f"save({path!r}): {MANIFEST} is the manifest's own name; pick another file name.")
    try:
        wait_for_saves(strategy)  # one save in flight: the one before is recorded before this one is pending
    except BaseException:
        if lineages is not None:
            lineages.locks.release(directory)  # held since that save, whose background write failed
        raise
    me = writers.me()

    def begin() -> Tuple[str, str, str]:
        rid = rendezvous.run_id()
        loaded = lineages.lineage(directory) if lineages is not None else None
        chosen = lineage.choose(loaded, (read_manifest(directory) or _empty())["checkpoints"], rid)
        try:
            with _Lock(directory):
                manifest = read_manifest(directory) or _empty()
                if lineages is not None:
                    lineages.locks.hold(directory)
                pending = [p for p in manifest.get("pending", [])
                           if not (p["name"] == name and p.get("writer") == me)]
                pending.append({"name": name, "run_id": rid, "lineage": chosen, "time": time.time(), "writer": me})
                write_manifest(directory, {**manifest, "pending": pending}, rid)
        except OSError:  # a full disk or a quota: the save itself fails next, naming its file and the cause
            if lineages is not None:
                lineages.locks.release(directory)
        return rid, f"{rid}-{writers.token(me)}", chosen

    # rank 0's run id, writer and lineage, on every rank: the tag names the temporaries every rank writes (a
    # sharded checkpoint's)
    rid, tag, chosen = on_rank_zero(strategy, begin)
    io = strategy.file_checkpoint_io

    def on_complete(files: Dict[str, Dict[str, Any]]) -> None:
        record(directory, name, rid, keep, files, io.remove_checkpoint, lineage_id=chosen, writer=me)

    def on_end() -> None:
        if lineages is not None:
            lineages.locks.release(directory)

    try:
        save_checkpoint(strategy, path, state, filter, tmp_tag=tag, on_complete=on_complete, on_end=on_end)
    except BaseException:
        if lineages is not None and strategy.is_global_zero:
            lineages.locks.release(directory)
        raise


def record(directory: str, name: str, rid: str, keep: int, files: Optional[Dict[str, Any]] = None,
           remove: Optional[Callable[[str], Any]] = None, lineage_id: Optional[str] = None,
           writer: Optional[writers.Writer] = None) -> List[str]:
    """Add ``name`` (complete; ``files``: its files' digests) as the newest checkpoint of run ``rid`` to
    ``directory``'s manifest, in lineage ``lineage_id`` (default: ``lineage.choose`` for ``rid``) written by
    ``writer``; drop the lineage's entries beyond the ``keep`` newest (``lineage.prune``) and settle pending
    entries (``lineage.settle_pending``); then delete the dropped checkpoints (a directory directly, a file with
    ``remove``, default: directly), what dead writers left, and this run's stray temporaries. Returns the names
    deleted. One process at a time per local directory (a lock file)."""
    alive = lineage.alive_in(directory)
    with _Lock(directory):
        manifest = read_manifest(directory) or _empty()
        chosen = lineage_id or lineage.choose(None, manifest["checkpoints"], rid)
        entries = [e for e in manifest["checkpoints"] if e["name"] != name]
        entry: Dict[str, Any] = {"name": name, "run_id": rid, "lineage": chosen, "time": time.time()}
        if writer is not None:
            entry["writer"] = writer
        if files:
            entry["files"] = files
        entries.append(entry)
        kept, dropped = lineage.prune(entries, chosen, keep, writer, alive)
        pending = [p for p in manifest.get("pending", []) if not (p["name"] == name and p.get("writer") == writer)]
        pending, abandoned = lineage.settle_pending(pending, kept, chosen, writer, alive)
        write_manifest(directory, {**manifest, "run_id": rid, "checkpoints": kept, "pending": pending}, rid)
        left = lineage.leftovers(directory, abandoned, kept) if abandoned else []
        if not remote_paths.is_remote(directory):
            left += lineage.dead_temporaries(directory, writer, alive)
    writing = {p["name"] for p in pending}  # a live writer is about to publish that name: leave the file
    deleted = []
    for dropped_entry in dropped:
        if dropped_entry["name"] not in writing and _delete(remote_paths.join(directory, dropped_entry["name"]),
                                                            remove):
            deleted.append(dropped_entry["name"])
    for leftover in left:
        if _delete(remote_paths.join(directory, leftover), remove if not leftover.startswith(".") else None):
            deleted.append(leftover)
    remove_stray_temporaries(directory, rid)
    return deleted


def latest(strategy: Any, directory: PathLike) -> Optional[str]:
    """The path of the newest checkpoint ``directory``'s manifest records whose file exists (None when there is
    none, or no directory), the same on every rank (rank 0 reads, then broadcasts). Raises ValueError, on every
    rank, when ``directory`` is a file or its manifest is not in this format. Rank 0 deletes this run's stray
    temporaries there. (``fabriclite.checkpoint.latest.load_latest`` also checks and loads it.)"""
    directory = check_directory(directory)

    def newest() -> Optional[str]:
        for entry in entries(directory):
            path = remote_paths.join(directory, entry["name"])
            if remote_paths.exists(path):
                return path
        return None

    return on_rank_zero(strategy, newest)


def check_directory(directory: PathLike) -> str:
    """``directory`` normalized; ValueError when it is a file."""
    directory = remote_paths.normalize(directory)
    if remote_paths.exists(directory) and not remote_paths.isdir(directory):
        raise ValueError(f"load_latest({directory!r}): that is a file, not a directory; pass the directory that "
                         "fabric.save(..., keep=K) writes its checkpoints into.")
    return directory


def entries(directory: str) -> List[Dict[str, Any]]:
    """The manifest's checkpoints, newest first (none without a manifest); this run's stray temporaries there
    are deleted. Call on one process."""
    manifest = read_manifest(directory)
    remove_stray_temporaries(directory, rendezvous.run_id())
    return list(reversed(manifest["checkpoints"])) if manifest else []


def on_rank_zero(strategy: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` run on global rank 0, its result broadcast to every rank; a ValueError or an OSError it raises (a
    manifest not in this format; a directory that cannot be written) is raised on every rank: the original on rank
    0, one of the same type with the same message elsewhere (no rank is left waiting)."""
    answer: Any = None
    failure: Optional[BaseException] = None
    if strategy.is_global_zero:
        try:
            answer = ("ok", fn())
        except (ValueError, OSError) as err:
            failure = err
            answer = ("OSError" if isinstance(err, OSError) else "ValueError", str(err))
    if strategy.world_size > 1:
        answer = collectives.broadcast(strategy, answer, src=0)
    if failure is not None:
        raise failure
    if answer[0] == "OSError":
        raise OSError(answer[1])
    if answer[0] == "ValueError":
        raise ValueError(answer[1])
    return answer[1]


def note_loaded(lineages: lineage.Lineages, path: str) -> None:
    """Note in ``lineages`` the lineage of the checkpoint at ``path`` when its directory's manifest records it (call
    on global rank 0 after loading it), so a later ``save(..., keep=K)`` there continues it. An unreadable manifest
    notes nothing."""
    path = remote_paths.normalize(path)
    directory, name = remote_paths.split(path)
    try:
        found = read_manifest(directory)
    except (ValueError, OSError):
        return
    lineages.loaded(directory, name, (found or {}).get("checkpoints", []))


def read_manifest(directory: str) -> Optional[Dict[str, Any]]:
    """``directory``'s manifest, or None when it has none; ValueError naming the file when it is not one."""
    path = remote_paths.join(directory, MANIFEST)
    try:
        raw = remote_paths.read_bytes(path)
    except NotADirectoryError:
        raise ValueError(f"{directory!r} is a file, not a directory; checkpoints with keep= need a directory.") \
            from None
    if raw is None:
        return None
    try:
        data = json.loads(raw.decode())
        ok = data.get("format") == FORMAT and isinstance(data.get("checkpoints"), list) and all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("run_id"), str)
            and os.path.basename(e["name"]) == e["name"] and isinstance(e.get("files", {}), dict)
            for e in data["checkpoints"]) and isinstance(data.get("pending", []), list) and all(
            isinstance(p, dict) and isinstance(p.get("name"), str) and os.path.basename(p["name"]) == p["name"]
            for p in data.get("pending", []))
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
    """Replace ``directory``'s manifest atomically (its temporary name carries ``rid``; a URL: one upload)."""
    text = json.dumps(manifest, indent=1)
    if remote_paths.is_remote(directory):
        remote_paths.write_bytes(remote_paths.join(directory, MANIFEST), text.encode())
        return
    os.makedirs(directory, exist_ok=True)
    tmp = tmp_name(directory, MANIFEST, rid, f"{writers.token(writers.me())}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        swap_in(tmp, os.path.join(directory, MANIFEST))
    except BaseException:
        remove_path(tmp)  # a full disk: no temporary left beside the manifest
        raise


def remove_stray_temporaries(directory: str, rid: str) -> None:
    """Delete ``.<name>.tmp-<rid>-...`` files in the local ``directory`` (only run ``rid``'s), but none whose name
    carries the token of another writer that is alive (``fabriclite.checkpoint.writers``)."""
    if remote_paths.is_remote(directory):
        return  # nothing is written under a temporary name there
    try:
        names = os.listdir(directory)
    except OSError:
        return
    marker = f".tmp-{rid}-"
    me = writers.me()
    for name in names:
        if name.startswith(".") and marker in name:
            writer = writers.parse(name)
            if writer is None or writer == me or writers.is_dead(writer, directory):
                remove_path(os.path.join(directory, name))


def _delete(path: str, remove: Optional[Callable[[str], Any]]) -> bool:
    """Delete a dropped checkpoint: a directory (sharded) directly, a file with ``remove`` when given."""
    if not remote_paths.exists(path):
        return False
    if remove is not None and not remote_paths.isdir(path):
        remove(path)
    elif remote_paths.is_remote(path):
        remote_paths.remove(path)
    else:
        remove_path(path)
    return True


def _empty() -> Dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "run_id": "", "checkpoints": [], "pending": []}


class _Lock:
    """An exclusive flock on ``<directory>/.fabriclite-manifest.lock`` (one manifest writer at a time); nothing on
    an fsspec URL (object stores have no lock: one job per directory there)."""

    def __init__(self, directory: str) -> None:
        self.path = None if remote_paths.is_remote(directory) else os.path.join(directory, ".fabriclite-manifest.lock")
        self.fd = -1

    def __enter__(self) -> "_Lock":
        if self.path is None:
            return self
        import fcntl

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # releases the lock
            self.fd = -1


__all__ = ["MANIFEST", "check_directory", "check_keep", "entries", "latest", "on_rank_zero", "read_manifest", "record",
           "save_recorded"]
