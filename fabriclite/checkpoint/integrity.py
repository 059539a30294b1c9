"""Checksums of checkpoint files: taken once a checkpoint is complete, recorded in the manifest, checked by
``load_latest`` before it trusts a checkpoint.

A manifest entry lists every file of the checkpoint by its path relative to the manifest's directory
(``step-5.ckpt``, or ``step-5/__1_0.distcp`` inside a sharded checkpoint) with its size and sha256. Flipped bytes
inside a tensor load without any error, a truncated file fails with a zip or pickle error naming nothing: the
size and the digest name both before anything is loaded. The work is shared: the file ``__<k>_...`` of a sharded
checkpoint (rank k's shard) is hashed by rank ``k % world_size``, every other file by rank 0.
"""
from __future__ import annotations

import hashlib
import os
import re
from typing import Any, Dict, List, Mapping, Optional

from fabriclite.checkpoint import remote_paths

ALGORITHM = "sha256"
_SHARD = re.compile(r"^__(\d+)_")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file that cannot be read (truncated, bytes changed, not a torch checkpoint). ``path`` is the
    file; the message says what is wrong with it."""

    def __init__(self, path: str, problem: str) -> None:
        self.path, self.problem = path, problem
        super().__init__(f"Checkpoint {path} cannot be loaded: {problem}")


def file_digest(path: str) -> Dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of the file at ``path`` (a local path or a remote URL)."""
    if remote_paths.is_remote(path):
        fs, inner = remote_paths.filesystem(path)
        opened = fs.open(inner, "rb")
    else:
        opened = open(path, "rb")
    with opened as f:
        digest = hashlib.file_digest(f, ALGORITHM)
        size = f.tell()
    return {"size": size, ALGORITHM: digest.hexdigest()}


def files_of(directory: str, name: str) -> List[str]:
    """The files of checkpoint ``name`` in ``directory``, relative to ``directory``: ``[name]`` for a file, every
    file below it for a directory (sorted), ``[]`` when nothing is there."""
    path = remote_paths.join(directory, name)
    if remote_paths.is_remote(path):
        fs, inner = remote_paths.filesystem(path)
        if not fs.exists(inner):
            return []
        if not fs.isdir(inner):
            return [name]
        return sorted(f"{name}/{p[len(inner):].lstrip('/')}" for p in fs.find(inner))
    if os.path.isfile(path):
        return [name]
    found = []
    for root, _, files in os.walk(path):
        found += [os.path.relpath(os.path.join(root, f), directory).replace(os.sep, "/") for f in files]
    return sorted(found)


def owner(relative: str, world_size: int) -> int:
    """The rank that hashes / checks ``relative``: rank k's shard ``__k_*`` goes to rank ``k % world_size``."""
    match = _SHARD.match(relative.rsplit("/", 1)[-1])
    return int(match.group(1)) % world_size if match else 0


def digests(directory: str, names: List[str], rank: int = 0, world_size: int = 1) -> Dict[str, Dict[str, Any]]:
    """This rank's share (see ``owner``) of the digests of ``names`` (relative to ``directory``)."""
    return {rel: file_digest(remote_paths.join(directory, rel)) for rel in names if owner(rel, world_size) == rank}


def problem(directory: str, files: Mapping[str, Mapping[str, Any]], rank: int = 0,
            world_size: int = 1) -> Optional[str]:
    """What is wrong with this rank's share of ``files`` (a manifest entry's record) in ``directory``: a missing
    file, a size or a digest that differs from the one recorded; None when every file is as written."""
    for rel in sorted(files):
        if owner(rel, world_size) != rank:
            continue
        expected = files[rel]
        path = remote_paths.join(directory, rel)
        try:
            found = file_digest(path)
        except FileNotFoundError:
            return f"{rel} is missing"
        except OSError as err:
            return f"{rel} cannot be read ({type(err).__name__}: {err})"
        if found["size"] != expected.get("size", found["size"]):
            return f"{rel} has {found['size']} bytes, {expected['size']} were written (truncated or overwritten)"
        if ALGORITHM in expected and found[ALGORITHM] != expected[ALGORITHM]:
            return (f"{rel} does not hold the bytes that were written ({ALGORITHM} {found[ALGORITHM][:12]}..., "
                    f"recorded {expected[ALGORITHM][:12]}...)")
    return None


__all__ = ["ALGORITHM", "CorruptCheckpointError", "digests", "file_digest", "files_of", "owner", "problem"]
