"""Checkpoints: one file, written atomically by global rank 0, read by every rank.

Format: ``torch.save`` of a plain dict in which modules, optimizers and other stateful objects (anything
with ``state_dict()`` and ``load_state_dict()``) are replaced by their state_dicts. That is also Lightning
Fabric's single-file format, so files move between the two both ways.

Atomic: rank 0 writes a temporary file in the target's directory (``.<name>.tmp-<pid>-<random>``), flushes
and fsyncs it, renames it over the target with ``os.replace`` and fsyncs the directory. A process killed
mid-write leaves the previous file at the target intact (and possibly a stray temporary file beside it).
Every rank returns from ``save`` only when the file is complete: the others wait for rank 0 through
``collectives.rank_zero_first`` (no deadline), and raise if rank 0's write raised.
"""
from __future__ import annotations

import os
import secrets
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
    ``tmp_tag`` goes into the temporary file's name (the manifest puts the run id there)."""
    from fabriclite import collectives

    check_filter(state, filter)
    checkpoint = strategy.checkpoint_state(to_saveable(strategy, state, filter))
    with collectives.rank_zero_first(strategy):
        if strategy.is_global_zero:
            atomic_save(checkpoint, path, tmp_tag)


def atomic_save(obj: Any, path: PathLike, tmp_tag: str = "") -> None:
    """``torch.save(obj)`` to ``path`` such that ``path`` holds either its previous content or all of the new
    one, whatever happens to this process; the directory is created if missing."""
    path = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    tag = f"{tmp_tag}-" if tmp_tag else ""
    tmp = os.path.join(directory, f".{name}.tmp-{tag}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(directory)


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
    must match exactly.
    """
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
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        if isinstance(obj, nn.Module):
            strategy.load_module_state_dict(obj, checkpoint.pop(key), strict=strict)
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


__all__ = ["atomic_save", "check_filter", "is_stateful", "load", "load_raw", "read", "save", "to_saveable"]
