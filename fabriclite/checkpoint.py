"""Checkpoints: one file written by global rank 0, or (sharded strategies) a directory every rank writes its
shard into; either is published atomically and read by every rank.

Format: ``torch.save`` of a plain dict in which modules, optimizers and other stateful objects (anything
with ``state_dict()`` and ``load_state_dict()``) are replaced by their state_dicts. That is also Lightning
Fabric's single-file format, so files move between the two both ways. A sharded strategy's directory
(``fabriclite.strategies.dcp``) is Lightning's: a torch.distributed.checkpoint directory plus ``meta.pt``.

Atomic (``publish``, one protocol for files and directories): the checkpoint is written under a temporary
name beside the target (``.<name>.tmp-<random>``; files flushed and fsynced). Once every rank is done, rank 0
swaps it in: a file with ``os.replace``; a directory (or a file replacing a directory, or the reverse) by
renaming the old one aside (``.<name>.old-<random>``), the new one in, then deleting the old one; then the
parent directory is fsynced. A process killed mid-write leaves the previous checkpoint at the target intact
(and possibly a stray temporary beside it); ``load`` of a target that a crash between the two renames left
missing renames the old one back first. Assumes one filesystem every rank writes to and reads from (shared by
all nodes; for a file, node 0's suffices). Every rank returns from ``save`` only when the checkpoint is
complete: the others wait for rank 0 through ``collectives.rank_zero_first`` (no deadline), and every rank
raises if any rank's write raised.
"""
from __future__ import annotations

import os
import secrets
import shutil
from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

if TYPE_CHECKING:
    from fabriclite.strategies.base import Strategy

PathLike = Union[str, "os.PathLike[str]"]
Filter = Dict[str, Callable[[str, Any], bool]]


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` is stored as its state_dict (has callable ``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)) \
        and not isinstance(obj, type)


def check_filter(state: Mapping[str, Any], filter: Optional[Filter]) -> None:
    """TypeError / ValueError for a ``filter`` that is not a dict of callables keyed by keys of ``state``."""
    if filter is None:
        return
    if not isinstance(filter, dict):
        raise TypeError(f"filter={filter!r}: expected a dict mapping state keys to callables (name, value) -> bool.")
    unknown = set(filter) - set(state)
    if unknown:
        raise ValueError(f"filter keys {sorted(unknown)} are not keys of the state ({sorted(state)}).")
    for key, fn in filter.items():
        if not callable(fn):
            raise TypeError(f"filter[{key!r}]={fn!r} is not callable; expected (name, value) -> bool.")


def to_saveable(strategy: Strategy, state: Mapping[str, Any], filter: Optional[Filter] = None) -> Dict[str, Any]:
    """``state`` with modules / optimizers / stateful objects replaced by their state_dicts and, for keys
    in ``filter``, only the entries ``filter[key](name, value)`` keeps."""
    out: Dict[str, Any] = {}
    filter = filter or {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            value = strategy.get_module_state_dict(obj)
        elif isinstance(obj, Optimizer):
            value = strategy.get_optimizer_state(obj)
        elif is_stateful(obj):
            value = obj.state_dict()
        else:
            value = obj
        if key in filter and isinstance(value, Mapping):
            keep = filter[key]
            value = {name: v for name, v in value.items() if keep(name, v)}
        out[key] = value
    return out


def save(strategy: Strategy, path: PathLike, state: Mapping[str, Any], filter: Optional[Filter] = None,
         tmp_tag: str = "") -> None:
    """Write ``state`` to ``path`` (see the module docstring). Call on every rank with the same path.
    ``tmp_tag`` goes into the temporary name (the manifest puts the run id there)."""
    check_filter(state, filter)
    writer = strategy.checkpoint_writer(dict(state), filter)
    if writer is not None:
        publish(strategy, path, writer.write, directory=True, tmp_tag=tmp_tag)
        return
    checkpoint = strategy.checkpoint_state(to_saveable(strategy, state, filter))
    publish(strategy, path, lambda tmp: _write_file(checkpoint, tmp), directory=False, tmp_tag=tmp_tag)


def _tmp_name(parent: str, name: str, tmp_tag: str, unique: str) -> str:
    """The temporary path beside ``parent/name``: ``.<name>.tmp-[<tmp_tag>-]<unique>``."""
    return os.path.join(parent, f".{name}.tmp-{tmp_tag + '-' if tmp_tag else ''}{unique}")


def publish(strategy: Strategy, path: PathLike, write: Callable[[str], None], directory: bool,
            tmp_tag: str = "") -> None:
    """The atomic protocol (module docstring): ``write(tmp)`` fills a temporary path beside ``path`` (every rank
    writes into a temporary directory; only global rank 0 writes a file), then, once every rank is done, rank 0
    swaps it in. Every rank returns when ``path`` holds the complete checkpoint, and raises if any rank's
    write raised (nothing is swapped in then, and the temporary is removed)."""
    from fabriclite import collectives

    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    if directory:
        token = strategy.broadcast_object(secrets.token_hex(4) if strategy.is_global_zero else None, 0)
        tmp = _tmp_name(parent, name, tmp_tag, token)
        error: Optional[BaseException] = None
        try:
            os.makedirs(parent, exist_ok=True)
            write(tmp)
        except BaseException as err:  # noqa: BLE001 - every rank must hear of it
            if not isinstance(err, Exception) and type(err).__name__ != "CheckpointException":
                raise  # KeyboardInterrupt, SystemExit (torch.distributed.checkpoint's errors are BaseExceptions)
            error = err
        outcomes = strategy.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
        failed = {rank: msg for rank, msg in enumerate(outcomes) if msg is not None}
        if failed:
            if strategy.is_global_zero:
                _remove(tmp)
            if error is not None:
                raise error
            raise RuntimeError(f"Saving {path} failed on rank(s) {sorted(failed)}: {failed}; nothing was written.")
    with collectives.rank_zero_first(strategy):
        if strategy.is_global_zero:
            if not directory:
                os.makedirs(parent, exist_ok=True)
                tmp = _tmp_name(parent, name, tmp_tag, f"{os.getpid()}-{secrets.token_hex(4)}")
                try:
                    write(tmp)
                except BaseException:
                    _remove(tmp)
                    raise
            swap_in(tmp, path)


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
        _remove(aside)


def recover(strategy: Strategy, path: PathLike) -> None:
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
    tmp = _tmp_name(directory, name, tmp_tag, f"{os.getpid()}-{secrets.token_hex(4)}")
    try:
        _write_file(obj, tmp)
        swap_in(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _write_file(obj: Any, tmp: str) -> None:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    with os.fdopen(fd, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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


def read(path: PathLike, weights_only: Optional[bool] = None) -> Any:
    """The object stored at ``path``, tensors on the CPU. ``weights_only``: None is torch.load's default
    (True: tensors, containers and primitives only); pass False for a trusted file holding other objects.
    FileNotFoundError naming the path when it does not exist."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    return torch.load(path, map_location="cpu", weights_only=weights_only)


def load(strategy: Strategy, path: PathLike, state: Any = None, strict: bool = True,
         weights_only: Optional[bool] = None) -> Dict[str, Any]:
    """Restore ``state`` in place from ``path`` and return what was not restored.

    ``state`` None / ``{}``: the whole checkpoint is returned. A module or an optimizer: the file holds its
    bare state_dict (``load_raw``). A dict: each key present in the file is restored into its object
    (modules / optimizers / stateful objects via ``load_state_dict``; any other value is replaced in the
    dict); with ``strict`` a key of ``state`` missing from the file is a KeyError and a module's state_dict
    must match exactly. A sharded checkpoint (a directory) loads into a run of any strategy and world size
    (``fabriclite.strategies.dcp.load_sharded``). A save that crashed between its renames is recovered first.
    """
    recover(strategy, path)
    if os.path.isdir(os.fspath(path)):
        from fabriclite.strategies import dcp

        if not dcp.is_sharded_checkpoint(os.fspath(path)):
            raise IsADirectoryError(f"{os.fspath(path)} is a directory but not a sharded checkpoint (it has neither "
                                    f"{dcp.METADATA_FILENAME} nor .metadata); pass the path of a checkpoint.")
        return dcp.load_sharded(strategy, os.fspath(path), state, strict=strict, weights_only=weights_only)
    checkpoint = read(path, weights_only=weights_only)
    if not state:
        return checkpoint
    if isinstance(state, nn.Module):
        strategy.load_module_state_dict(state, checkpoint, strict=strict)
        return {}
    if isinstance(state, Optimizer):
        state.load_state_dict(checkpoint)
        return {}
    if not isinstance(checkpoint, dict):
        raise TypeError(f"{os.fspath(path)} holds a {type(checkpoint).__name__}, not a dict of named states; "
                        "use load_raw(path, module) for a bare state_dict.")
    missing = [key for key in state if key not in checkpoint]
    if strict and missing:
        raise KeyError(f"The requested state contains key {missing[0]!r}, which is not in the checkpoint "
                       f"{os.fspath(path)} (it has {sorted(checkpoint)}). Pass strict=False to skip missing keys.")
    modules = [obj for obj in state.values() if isinstance(obj, nn.Module)]
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        if isinstance(obj, nn.Module):
            strategy.load_module_state_dict(obj, checkpoint.pop(key), strict=strict)
        elif isinstance(obj, Optimizer):
            from fabriclite.strategies.dcp import load_optimizer_state

            load_optimizer_state(modules[0] if len(modules) == 1 else None, obj, checkpoint.pop(key))
        elif is_stateful(obj):
            obj.load_state_dict(checkpoint.pop(key))
        else:
            state[key] = checkpoint.pop(key)
    return checkpoint


def load_raw(strategy: Strategy, path: PathLike, obj: Union[nn.Module, Optimizer], strict: bool = True,
             weights_only: Optional[bool] = None) -> None:
    """Load a bare state_dict file (e.g. ``torch.save(model.state_dict(), path)``) into ``obj``."""
    if not isinstance(obj, (nn.Module, Optimizer)):
        raise TypeError(f"load_raw(path, obj): obj must be a torch.nn.Module or torch.optim.Optimizer; got "
                        f"{type(obj).__name__}.")
    load(strategy, path, obj, strict=strict, weights_only=weights_only)


__all__ = ["atomic_save", "check_filter", "is_stateful", "load", "load_raw", "publish", "read", "recover", "save",
           "swap_in", "to_saveable"]
