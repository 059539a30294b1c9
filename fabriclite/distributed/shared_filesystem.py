"""``is_shared_filesystem``: whether every rank sees the same directory (for checkpoint paths)."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Optional, Union


def is_shared_filesystem(strategy: Any, path: Optional[Union[str, "os.PathLike[str]"]] = None,
                         timeout: int = 3) -> bool:
    """True when ``path`` (default: the working directory) is one shared filesystem for every rank of
    ``strategy`` (``fabric.strategy``), the same answer on every rank. Call it on every rank after launch.

    A URL (``s3://...``) counts as shared; one rank counts as shared. Otherwise rank 0 creates a marker file in
    ``path`` and the others look for it for up to ``timeout`` seconds. FileNotFoundError on every rank when
    ``path`` does not exist on some rank."""
    if path is not None and "://" in str(path) and not str(path).startswith("file://"):
        return True
    resolved = Path(Path.cwd() if path is None else path).resolve()
    if getattr(strategy, "world_size", 1) == 1:
        return True
    if not strategy.reduce_boolean_decision(strategy.broadcast(resolved) == resolved, all=True):
        return False
    if not strategy.reduce_boolean_decision(resolved.exists(), all=True):
        raise FileNotFoundError(f"is_shared_filesystem(path={str(resolved)!r}): the path does not exist on every "
                                "rank; create it first.")
    directory = resolved.parent if resolved.is_file() else resolved
    marker = directory / ".fabriclite_shared_fs_check"
    marker.unlink(missing_ok=True)  # every rank: a stale marker on an unshared disk must not count
    strategy.barrier()
    if strategy.is_global_zero:
        marker.touch()
        found = True
    else:
        deadline = time.monotonic() + timeout
        found = marker.exists()
        while not found and time.monotonic() < deadline:
            time.sleep(0.01)
            found = marker.exists()
    strategy.barrier()
    shared = strategy.reduce_boolean_decision(found, all=True)
    if strategy.is_global_zero:
        with contextlib.suppress(OSError):
            marker.unlink()
    return shared
