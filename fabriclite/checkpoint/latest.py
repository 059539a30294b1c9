"""``fabric.load_latest``: the newest checkpoint the manifest records that loads, falling back to older ones.

Asynchronous saves in flight are waited for first. Global rank 0 then reads the manifest (``fabriclite.checkpoint.manifest``); its checkpoints are tried newest first.
Before one is loaded, its files are checked against the sizes and sha256 digests recorded when it was saved
(``fabriclite.checkpoint.integrity``; the ranks share the work): a missing file or shard, a truncated file or
changed bytes skip it with a warning naming the file and what is wrong. One that passes (or was recorded without
digests: by an older fabriclite, or written by a CheckpointIO plugin somewhere fabriclite cannot read) is loaded;
if loading fails on any rank with an unreadable file (``CorruptCheckpointError``, ``FileNotFoundError``,
torch.distributed.checkpoint's ``CheckpointException``), every rank warns and tries the next older one. Any other
error (keys that do not match with ``strict=True``, a wrong type) is raised at once: an older checkpoint would not
fix it. When none loads: ``NoLoadableCheckpointError`` listing each one tried and why. The same checkpoint is
chosen on every rank (the outcomes are agreed by one small collective per attempt).

When the manifest records nothing (or there is none) but the folder holds what ``save`` writes without
``keep=`` (``*.ckpt``, ``*.pt``, ``*.pth`` files, sharded-checkpoint folders), ``load_latest`` still returns
None, and global rank 0 warns once, naming those files: only ``save(..., keep=K)`` records a checkpoint, and a
job that silently started again from step 0 is the trap. Local paths and fsspec URLs alike.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable, List, Optional, Tuple, Union

from fabriclite.checkpoint import integrity, manifest, remote_paths
from fabriclite.checkpoint.integrity import CorruptCheckpointError
from fabriclite.checkpoint.saving import wait_for_saves

PathLike = Union[str, "os.PathLike[str]"]

#: the file suffixes ``save`` is usually given (Lightning's ``.ckpt``, torch's ``.pt`` / ``.pth``)
CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")
#: how many unrecorded checkpoints the warning names before "and N more"
NAMED = 8


class NoLoadableCheckpointError(RuntimeError):
    """``load_latest`` found checkpoints in the manifest, but none of them loads; ``tried`` lists
    ``(path, reason)`` for each, newest first."""

    def __init__(self, directory: str, tried: List[Tuple[str, str]]) -> None:
        self.tried = tried
        lines = "".join(f"\n  {path}: {reason}" for path, reason in tried)
        super().__init__(f"load_latest({directory!r}): none of the {len(tried)} checkpoints its manifest records "
                         f"can be loaded; nothing was loaded. Tried, newest first:{lines}")


def load_latest(strategy: Any, directory: PathLike, load: Callable[[str], Any]) -> Optional[str]:
    """``load(path)`` of the newest loadable checkpoint in ``directory`` (see the module docstring); its path, or
    None when the manifest records none (or there is no manifest). Call on every rank."""
    directory = manifest.check_directory(directory)
    wait_for_saves(strategy)  # a save in flight is recorded first: it may be the newest
    candidates = manifest.on_rank_zero(strategy, lambda: [(e["name"], e.get("files") or {})
                                                          for e in manifest.entries(directory)])
    tried: List[Tuple[str, str]] = []
    for name, files in candidates:
        path = remote_paths.join(directory, name)
        reason = _check(strategy, directory, name, files)
        if reason is None:
            reason = _load(strategy, path, load)
            if reason is None:
                return path
        if strategy.is_global_zero:
            warnings.warn(f"load_latest: skipping the checkpoint {path}: {reason.rstrip('.')}. Trying an older one.",
                          stacklevel=3)
        tried.append((path, reason))
    if tried:
        raise NoLoadableCheckpointError(directory, tried)
    if strategy.is_global_zero and not candidates:
        warn_unrecorded(directory)
    return None


def unrecorded_checkpoints(directory: str) -> List[str]:
    """The names in ``directory`` (a local path or an fsspec URL) that look like what ``save`` writes: files
    ending in ``.ckpt`` / ``.pt`` / ``.pth`` and sharded-checkpoint folders (``meta.pt`` or ``.metadata``
    inside); temporaries (names starting with ``.``) left out. Sorted."""
    from fabriclite.checkpoint.dcp import DCP_METADATA, METADATA_FILENAME

    found = []
    for name, is_dir in remote_paths.listdir(directory):
        if name.startswith("."):
            continue
        if is_dir:
            inside = remote_paths.join(directory, name)
            if any(remote_paths.exists(remote_paths.join(inside, marker)) for marker in (METADATA_FILENAME,
                                                                                          DCP_METADATA)):
                found.append(name + "/")
        elif name.endswith(CHECKPOINT_SUFFIXES):
            found.append(name)
    return found


def warn_unrecorded(directory: str) -> None:
    """Warn (once per directory and message, Python's default filter) that ``directory`` holds checkpoints that
    no manifest records, naming them. Call on one process."""
    try:
        pending = {p["name"] for p in (manifest.read_manifest(directory) or {}).get("pending", [])}
    except ValueError:
        pending = set()
    # a save killed before its record left its checkpoint pending: the next save removes it, nothing to say
    names = [name for name in unrecorded_checkpoints(directory) if name.rstrip("/") not in pending]
    if not names:
        return
    listed = ", ".join(names[:NAMED]) + (f" and {len(names) - NAMED} more" if len(names) > NAMED else "")
    warnings.warn(f"load_latest({directory!r}) found no recorded checkpoint, so nothing was loaded (the job starts "
                  f"from the beginning), but the folder holds {len(names)} checkpoint(s) that were saved without "
                  f"being recorded: {listed}. Only fabric.save(path, state, keep=K) records a checkpoint for "
                  "load_latest; save with keep=K from now on, or load one of these with fabric.load(path, state).",
                  UserWarning, stacklevel=4)


def _check(strategy: Any, directory: str, name: str, files: dict) -> Optional[str]:
    """What is wrong with the files of checkpoint ``name`` (every rank checks its share), agreed on every rank."""
    if files:
        mine = integrity.problem(directory, files, strategy.global_rank, strategy.world_size)
    elif strategy.is_global_zero:  # recorded without digests: it must exist, at least
        mine = None if remote_paths.exists(remote_paths.join(directory, name)) else f"{name} is missing"
    else:
        mine = None
    return _first(strategy, mine)


def _load(strategy: Any, path: str, load: Callable[[str], Any]) -> Optional[str]:
    """None when ``load(path)`` worked on every rank; the reason when it failed somewhere on an unreadable file.
    Any other error is raised on every rank (the original where it happened)."""
    unreadable: Optional[str] = None
    other: Optional[BaseException] = None
    try:
        load(path)
    except (CorruptCheckpointError, FileNotFoundError) as err:
        unreadable = str(err)
    except Exception as err:  # noqa: BLE001 - sorted below, then raised or reported
        if type(err).__name__ == "CheckpointException":
            unreadable = f"{type(err).__name__}: {err}"
        else:
            other = err
    outcomes = [(unreadable, None if other is None else f"{type(other).__name__}: {other}")]
    if strategy.world_size > 1:
        outcomes = strategy.all_gather_object(outcomes[0])
    if other is not None:
        raise other
    fatal = [(rank, msg) for rank, (_, msg) in enumerate(outcomes) if msg is not None]
    if fatal:
        raise RuntimeError(f"load_latest: loading {path} failed on rank {fatal[0][0]}: {fatal[0][1]}")
    reasons = [(rank, msg) for rank, (msg, _) in enumerate(outcomes) if msg is not None]
    if not reasons:
        return None
    rank, msg = reasons[0]
    return msg if strategy.world_size == 1 else f"(rank {rank}) {msg}"


def _first(strategy: Any, mine: Optional[str]) -> Optional[str]:
    found = [mine] if strategy.world_size == 1 else strategy.all_gather_object(mine)
    return next((reason for reason in found if reason is not None), None)


__all__ = ["NoLoadableCheckpointError", "load_latest", "unrecorded_checkpoints", "warn_unrecorded"]
