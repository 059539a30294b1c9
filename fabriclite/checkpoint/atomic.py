"""The atomic publish protocol every checkpoint writer goes through: files and directories alike.

The checkpoint is written under a temporary name beside the target (``.<name>.tmp-[<tag>-]<unique>``; files
flushed and fsynced). Once every rank is done, rank 0 swaps it in: a file with ``os.replace``; a directory (or a
file replacing a directory, or the reverse) by renaming the old one aside (``.<name>.old-<random>``), the new one
in, then deleting the old one; then the parent directory is fsynced. A process killed mid-write leaves the
previous checkpoint at the target intact (and possibly a stray temporary beside it); ``recover`` puts back a
checkpoint that a crash between the two renames left aside. Assumes one filesystem every rank writes to and
reads from (shared by all nodes; for a file, node 0's suffices). Every rank returns from ``publish`` only when
the checkpoint is complete, and every rank raises if any rank's write raised.
"""
from __future__ import annotations

import os
import secrets
import shutil
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

from fabriclite import collectives
from fabriclite.checkpoint import writers

PathLike = Union[str, "os.PathLike[str]"]


def tmp_name(parent: str, name: str, tmp_tag: str, unique: str) -> str:
    """The temporary path beside ``parent/name``: ``.<name>.tmp-[<tmp_tag>-]<unique>``."""
    return os.path.join(parent, f".{name}.tmp-{tmp_tag + '-' if tmp_tag else ''}{unique}")


def publish(strategy: Any, path: PathLike, write: Callable[[str], None], tmp_tag: str = "") -> None:
    """The atomic protocol for a directory every rank writes into (module docstring): ``write(tmp)`` fills a
    temporary directory beside ``path`` on every rank, then, once every rank is done, rank 0 swaps it in. Every
    rank returns when ``path`` holds the complete checkpoint, and raises if any rank's write raised (nothing is
    swapped in then, and the temporary is removed). One-file checkpoints go through the strategy's CheckpointIO
    instead (``TorchCheckpointIO`` writes with ``atomic_save``)."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    # every rank writes into rank 0's temporary: its tag too (a run id can differ between processes that no
    # supervisor started, e.g. under plain mpirun), or the other ranks' shards go to strays
    tmp_tag, token = strategy.broadcast_object((tmp_tag, secrets.token_hex(4)) if strategy.is_global_zero else None, 0)
    tmp = tmp_name(parent, name, tmp_tag, token)
    error: Optional[BaseException] = None
    try:
        os.makedirs(parent, exist_ok=True)
        write(tmp)
    except BaseException as err:  # noqa: BLE001 - every rank must hear of it
        if not isinstance(err, Exception) and type(err).__name__ != "CheckpointException":
            raise  # KeyboardInterrupt, SystemExit (torch.distributed.checkpoint's errors are BaseExceptions)
        error = err
    outcomes = strategy.all_gather_object(outcome(error, strategy.global_rank))
    if any(outcomes):
        if strategy.is_global_zero:
            remove_path(tmp)
        raise_failure(path, outcomes, error)
    with collectives.rank_zero_first(strategy):
        if strategy.is_global_zero:
            swap_in(tmp, path)


def outcome(error: Optional[BaseException], rank: int) -> Optional[Tuple[str, bool]]:
    """What rank ``rank`` tells the others of its write: None when it did not fail, else ``(message, is an
    OSError)``. A torch.distributed.checkpoint error that lists only other ranks' failures (DCP raises every
    rank's failures on every rank) is an echo: ``("", False)``, a failure that ``raise_failure`` does not name."""
    if error is None:
        return None
    failures = getattr(error, "failures", None)
    if type(error).__name__ == "CheckpointException" and isinstance(failures, dict) and failures \
            and rank not in failures:
        return "", False
    return f"{type(error).__name__}: {error}", isinstance(error, OSError)


def raise_failure(path: str, outcomes: List[Optional[Tuple[str, bool]]], error: Optional[BaseException]) -> None:
    """Raise, on a rank of a failed save: its own OSError (a full disk: it names the path and the cause), else
    its own error when no rank had an OSError, else one naming every failed rank and its error. ``outcomes``: every
    rank's ``(message, is an OSError)`` or None (``outcome``)."""
    failed = {rank: told[0] for rank, told in enumerate(outcomes) if told is not None and told[0]}
    os_errors = {rank: told[0] for rank, told in enumerate(outcomes) if told is not None and told[1]}
    if isinstance(error, OSError) or (error is not None and not os_errors):
        raise error
    raise RuntimeError(f"Saving {path} failed on rank(s) {sorted(failed)}: {os_errors or failed}; nothing was "
                       "written, the previous checkpoint at that path (if any) is intact.") from error


def swap_in(tmp: str, path: str) -> None:
    """Make the complete ``tmp`` (file or directory) appear at ``path``: ``os.replace`` for a file over a file
    (or nothing); otherwise old aside, new in, old deleted. The parent directory is fsynced after each step."""
    parent, name = os.path.split(path)
    if not os.path.isdir(tmp) and not os.path.isdir(path):
        os.replace(tmp, path)
        _fsync_dir(parent)
        return
    aside = None
    if os.path.lexists(path):
        aside = os.path.join(parent, f".{name}.old-{secrets.token_hex(4)}")
        os.rename(path, aside)
        _fsync_dir(parent)
    os.rename(tmp, path)
    _fsync_dir(parent)
    if aside is not None:
        remove_path(aside)


def recover(strategy: Any, path: PathLike) -> None:
    """If ``path`` is missing because a save crashed between its two renames, put the previous checkpoint (renamed
    aside) back. Global rank 0 looks and acts; every rank returns after (one small broadcast)."""
    path = os.path.abspath(os.fspath(path))
    if strategy.is_global_zero:
        _recover_here(path)
    if strategy.world_size > 1:
        strategy.broadcast_object(None, 0)


def _recover_here(path: str) -> None:
    parent, name = os.path.split(path)
    if os.path.lexists(path) or not os.path.isdir(parent):
        return
    asides = sorted((os.path.join(parent, f) for f in os.listdir(parent) if f.startswith(f".{name}.old-")),
                    key=os.path.getmtime)
    if asides:
        os.rename(asides[-1], path)
        _fsync_dir(parent)


def atomic_save(obj: Any, path: PathLike, tmp_tag: str = "") -> None:
    """``torch.save(obj)`` to ``path`` such that ``path`` holds either its previous content or all of the new
    one, whatever happens to this process; the directory is created if missing. One process only: no collectives."""
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    tmp = tmp_name(directory, name, tmp_tag, f"{writers.token(writers.me())}-{secrets.token_hex(4)}")
    try:
        write_file(obj, tmp)
        swap_in(tmp, path)
    except BaseException:
        remove_path(tmp)
        raise


def write_file(obj: Any, tmp: str) -> None:
    """``torch.save(obj)`` into the new file ``tmp``, flushed and fsynced (it must not exist). An OSError of the
    writes (a full disk, a file-size limit) is raised as itself (torch.save would report a bare position
    mismatch)."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "wb") as f:
        writes = WriteErrors()
        try:
            torch.save(obj, writes.wrap(f))
        except RuntimeError:
            if writes.first is not None:
                raise writes.first from None
            raise
        f.flush()
        os.fsync(f.fileno())


class WriteErrors:
    """Streams wrapped by ``wrap`` keep the first OSError a ``write`` raised: ``torch.save`` (also inside
    torch.distributed.checkpoint) replaces it with ``unexpected pos N vs M``, which names neither the file nor the
    cause."""

    def __init__(self) -> None:
        self.first: Optional[OSError] = None
        self.path = ""

    def wrap(self, stream: Any, path: str = "") -> Any:
        return _Recording(stream, self, path)

    def note(self, err: OSError, path: str = "") -> None:
        """Keep ``err`` (raised writing ``path``) unless an earlier OSError was kept."""
        if self.first is None:
            self.first, self.path = err, path

    def raise_recorded(self, path: str, err: BaseException) -> None:
        """If a write failed with an OSError: raise it again, naming ``path`` and the cause (``err`` chained)."""
        if self.first is not None:
            first = self.first
            raise OSError(first.errno, f"Saving the checkpoint {path} failed: {first.strerror or first}"
                                       f"{f' (writing {self.path})' if self.path else ''}") from err


class _Recording:
    """A stream whose ``write``, ``flush`` and ``close`` record their OSError in ``errors`` (a buffered file
    reaches the disk, and fails, in any of them); everything else is the stream's."""

    def __init__(self, stream: Any, errors: WriteErrors, path: str) -> None:
        self._stream, self._errors, self._path = stream, errors, path

    def write(self, data: Any) -> int:
        return self._recorded(self._stream.write, data)

    def flush(self) -> None:
        self._recorded(self._stream.flush)

    def close(self) -> None:
        self._recorded(self._stream.close)

    def _recorded(self, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args)
        except OSError as err:
            self._errors.note(err, self._path)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def remove_path(path: str) -> bool:
    """Delete the file or directory tree at ``path``; False when there was nothing."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
        return True
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


__all__ = ["WriteErrors", "atomic_save", "outcome", "publish", "raise_failure", "recover", "remove_path", "swap_in",
           "tmp_name", "write_file"]
