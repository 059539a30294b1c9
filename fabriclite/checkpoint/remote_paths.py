"""Checkpoint paths that are URLs (``s3://bucket/run``, ``gs://...``, ``memory://...``), reached through fsspec.

A plain path or a ``file://`` URL is *local*: the atomic protocol of ``fabriclite.checkpoint.atomic`` applies
(temporary name, fsync, rename, the manifest's file lock). Any other URL is *remote*: an object store (or any
filesystem fsspec reaches) has no rename and no lock, so a checkpoint is written at its final name (an object
appears whole when its upload completes, never half) and the manifest, written after it, is the commit point:
``load_latest`` trusts only what the manifest records. fsspec (a dependency of torch) is imported only for URLs;
the filesystem package of a protocol (``s3fs``, ``gcsfs``...) is the user's to install.
"""
from __future__ import annotations

import os
import posixpath
from typing import Any, List, Optional, Tuple, Union

PathLike = Union[str, "os.PathLike[str]"]


def is_remote(path: PathLike) -> bool:
    """Whether ``path`` is a URL other than ``file://`` (an object store or another fsspec filesystem)."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def normalize(path: PathLike) -> str:
    """A local path made absolute (a ``file://`` URL becomes its path); a remote URL as given, without a trailing
    ``/``."""
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if is_remote(text):
        return text.rstrip("/")
    return os.path.abspath(text)


def filesystem(url: str) -> Tuple[Any, str]:
    """``(fsspec filesystem, path inside it)`` for a remote ``url``; ImportError naming the package to install
    when fsspec does not know the protocol."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as err:
        protocol = url.split("://", 1)[0]
        raise ImportError(f"Checkpoint path {url!r}: fsspec cannot open {protocol}:// URLs ({err}). Install the "
                          f"filesystem package for {protocol}:// (s3fs for s3://, gcsfs for gs://, adlfs for az://).") \
            from err


def join(directory: str, name: str) -> str:
    """``directory/name`` (``/`` for URLs)."""
    return posixpath.join(directory, name) if is_remote(directory) else os.path.join(directory, name)


def split(path: str) -> Tuple[str, str]:
    """``(directory, name)`` of a normalized path."""
    return posixpath.split(path) if is_remote(path) else os.path.split(path)


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.lexists(path)
    fs, inner = filesystem(path)
    return fs.exists(inner)


def isdir(path: str) -> bool:
    if not is_remote(path):
        return os.path.isdir(path)
    fs, inner = filesystem(path)
    return fs.isdir(inner)


def listdir(directory: str) -> List[Tuple[str, bool]]:
    """``(name, is a directory)`` for each entry of ``directory``, sorted by name; empty when it does not exist."""
    if not is_remote(directory):
        try:
            names = sorted(os.listdir(directory))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [(name, os.path.isdir(os.path.join(directory, name))) for name in names]
    fs, inner = filesystem(directory)
    try:
        found = fs.ls(inner, detail=True)
    except FileNotFoundError:
        return []
    inner = inner.rstrip("/")
    listed = [(posixpath.basename(info["name"].rstrip("/")), info.get("type") == "directory") for info in found
              if info["name"].rstrip("/") != inner]
    return sorted(listed)


def read_bytes(path: str) -> Optional[bytes]:
    """The bytes at ``path``, or None when there is no such file."""
    try:
        if not is_remote(path):
            with open(path, "rb") as f:
                return f.read()
        fs, inner = filesystem(path)
        return fs.cat_file(inner)
    except FileNotFoundError:
        return None


def write_bytes(path: str, data: bytes) -> None:
    """Put ``data`` at the remote ``path`` in one upload (the object appears whole or not at all)."""
    fs, inner = filesystem(path)
    fs.makedirs(posixpath.dirname(inner), exist_ok=True)
    fs.pipe_file(inner, data)


def remove(path: str) -> bool:
    """Delete the file or directory tree at the remote ``path``; False when there was nothing."""
    fs, inner = filesystem(path)
    if not fs.exists(inner):
        return False
    fs.rm(inner, recursive=True)
    return True


__all__ = ["exists", "filesystem", "is_remote", "isdir", "join", "listdir", "normalize", "read_bytes", "remove",
           "split", "write_bytes"]
