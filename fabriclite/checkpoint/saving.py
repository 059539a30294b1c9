"""Saving and loading a script's state: one file written by global rank 0 through the strategy's CheckpointIO
(``fabriclite.checkpoint.checkpoint_io``; atomic by default), or (sharded strategies) a directory every rank writes
its shard into, published through ``fabriclite.checkpoint.atomic``; either is read by every rank. Asynchronous
saves (``fabriclite.checkpoint.async_save``) take the same paths, in the background.

Format: ``torch.save`` of a plain dict in which modules, optimizers and other stateful objects (anything
with ``state_dict()`` and ``load_state_dict()``) are replaced by their state_dicts. That is also Lightning
Fabric's single-file format, so files move between the two both ways. A sharded strategy's directory
(``fabriclite.checkpoint.dcp``) is Lightning's: a torch.distributed.checkpoint directory plus ``meta.pt``.
Every rank returns from ``save_checkpoint`` only when the checkpoint is complete, and raises if any rank's
write raised.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Mapping, Optional, Union

from torch import nn
from torch.optim import Optimizer

from fabriclite import collectives
from fabriclite.checkpoint import integrity, remote_paths, safe_loading
from fabriclite.checkpoint.async_save import AsyncCheckpointIO, OnComplete
from fabriclite.checkpoint.atomic import publish, recover
from fabriclite.checkpoint.checkpoint_io import TorchCheckpointIO

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


def to_saveable(strategy: Any, state: Mapping[str, Any], filter: Optional[Filter] = None) -> Dict[str, Any]:
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


def save_checkpoint(strategy: Any, path: PathLike, state: Mapping[str, Any], filter: Optional[Filter] = None,
                    storage_options: Optional[Any] = None, tmp_tag: str = "",
                    on_complete: Optional[OnComplete] = None, on_end: Optional[Callable[[], None]] = None) -> None:
    """Write ``state`` to ``path`` (see the module docstring). Call on every rank with the same path.

    One file: global rank 0 hands the state_dicts to the strategy's CheckpointIO (``storage_options`` passed
    through); every rank returns once it returned (an ``AsyncCheckpointIO`` returns once the snapshot is taken).
    A sharded directory: every rank writes its shard (TypeError for ``storage_options``, as in Lightning).
    ``tmp_tag`` goes into temporary names (the manifest puts the run id there). ``on_complete(files)`` runs on
    global rank 0 once the checkpoint is complete on every rank (later, in the background, for asynchronous
    saves), with its files' digests (``fabriclite.checkpoint.integrity``). ``on_end()`` runs on global rank 0 once
    the save has ended, complete or failed (in the background for asynchronous saves that started)."""
    check_filter(state, filter)
    target = remote_paths.normalize(path)
    writer = strategy.checkpoint_writer(dict(state), filter)
    if writer is not None:
        if storage_options is not None:
            raise TypeError(f"`{type(strategy).__name__}.save_checkpoint(..., storage_options=...)` is not supported "
                            f"because `{type(strategy).__name__}` does not use the `CheckpointIO`.")
        if remote_paths.is_remote(target):
            raise NotImplementedError(f"save({target!r}): sharded checkpoints are written to local (or mounted "
                                      "shared) directories only; save to a shared filesystem path, or use "
                                      "state_dict_type='full' for one file through fsspec.")
        saver = getattr(strategy, "async_saves", None)
        if saver is not None:
            saver.save(strategy, target, writer, tmp_tag, on_complete, on_end)
            return
        try:
            publish(strategy, target, lambda tmp: writer.write(tmp, named=os.path.abspath(target)), tmp_tag=tmp_tag)
            if on_complete is not None:
                _complete_directory(strategy, target, on_complete)
        finally:
            if on_end is not None and strategy.is_global_zero:
                on_end()
        return
    checkpoint = strategy.checkpoint_state(to_saveable(strategy, state, filter))
    io = strategy.file_checkpoint_io
    directory, name = remote_paths.split(target)

    def complete() -> None:
        assert on_complete is not None
        on_complete(integrity.digests(directory, integrity.files_of(directory, name)))

    with collectives.rank_zero_first(strategy):
        if strategy.is_global_zero:
            if isinstance(io, AsyncCheckpointIO):
                io.save_in_background(checkpoint, target, storage_options, then=complete if on_complete else None,
                                      end=on_end)
            else:
                try:
                    io.save_checkpoint(checkpoint, target, storage_options=storage_options)
                    if on_complete is not None:
                        complete()
                finally:
                    if on_end is not None:
                        on_end()


def _complete_directory(strategy: Any, path: str, on_complete: OnComplete) -> None:
    """Digests of a complete sharded checkpoint, each rank hashing its share, then ``on_complete`` on rank 0."""
    directory, name = os.path.split(path)
    names = integrity.files_of(directory, name) if strategy.is_global_zero else None
    if strategy.world_size > 1:
        names = strategy.broadcast_object(names, 0)
    mine = integrity.digests(directory, names, strategy.global_rank, strategy.world_size)
    shares = strategy.all_gather_object(mine) if strategy.world_size > 1 else [mine]
    with collectives.rank_zero_first(strategy):
        if strategy.is_global_zero:
            on_complete({k: v for share in shares for k, v in share.items()})


def wait_for_saves(strategy: Any) -> None:
    """Block until the asynchronous saves in flight (if the strategy makes any) are complete; their error, if
    one failed, is raised on every rank (rank 0 first). Call on every rank."""
    if not strategy.saves_in_background:
        return
    with collectives.rank_zero_first(strategy):
        strategy.wait_for_checkpoints()


def read(path: PathLike, io: Any = None, weights_only: Optional[bool] = None) -> Any:
    """The object stored at ``path``, tensors on the CPU, read by ``io`` (default ``TorchCheckpointIO``).
    ``weights_only``: None is True (tensors, containers and primitives only, and what ``fabriclite.add_safe_globals``
    allowed), passed to the plugin as True, so ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` does not turn it off; pass
    False for a trusted file holding other objects. FileNotFoundError naming the path when it does not exist,
    CorruptCheckpointError naming it when it cannot be read."""
    io = io if io is not None else TorchCheckpointIO()
    return io.load_checkpoint(path, map_location="cpu", weights_only=safe_loading.resolve_weights_only(weights_only))


def load_checkpoint(strategy: Any, path: PathLike, state: Any = None, strict: bool = True,
         weights_only: Optional[bool] = None) -> Dict[str, Any]:
    """Restore ``state`` in place from ``path`` and return what was not restored.

    ``state`` None / ``{}``: the whole checkpoint is returned. A module or an optimizer: the file holds its
    bare state_dict (``load_raw``). A dict: each key present in the file is restored into its object
    (modules / optimizers / stateful objects via ``load_state_dict``; any other value is replaced in the
    dict); with ``strict`` a key of ``state`` missing from the file is a KeyError and a module's state_dict
    must match exactly. A sharded checkpoint (a directory) loads into a run of any strategy and world size
    (``fabriclite.checkpoint.dcp.load_sharded``). A save that crashed between its renames is recovered first.
    ``weights_only``: None is True, whatever ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says (``read``); on torch < 2.10
    the first load warns of CVE-2026-24747 (``fabriclite.checkpoint.safe_loading``).
    """
    weights_only = safe_loading.resolve_weights_only(weights_only)
    safe_loading.warn_vulnerable_torch()
    path = remote_paths.normalize(path)
    wait_for_saves(strategy)
    if not remote_paths.is_remote(path):
        recover(strategy, path)
    if not remote_paths.is_remote(path) and os.path.isdir(path):
        from fabriclite.checkpoint import dcp

        if not dcp.is_sharded_checkpoint(path):
            raise IsADirectoryError(f"{path} is a directory but not a sharded checkpoint (it has neither "
                                    f"{dcp.METADATA_FILENAME} nor .metadata); pass the path of a checkpoint.")
        return dcp.load_sharded(strategy, path, state, strict=strict, weights_only=weights_only)
    checkpoint = read(path, strategy.file_checkpoint_io, weights_only=weights_only)
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
    return restore_into(strategy, state, checkpoint, strict, f"the checkpoint {os.fspath(path)}")


def restore_into(strategy: Any, state: Dict[str, Any], checkpoint: Dict[str, Any], strict: bool = True,
                 source: str = "the checkpoint") -> Dict[str, Any]:
    """Restore ``state`` in place from ``checkpoint`` (a dict as ``to_saveable`` makes it; consumed) and return
    what was not restored: see ``load_checkpoint``. ``source`` names it in the KeyError of a missing key."""
    missing = [key for key in state if key not in checkpoint]
    if strict and missing:
        raise KeyError(f"The requested state contains key {missing[0]!r}, which is not in {source} "
                       f"(it has {sorted(checkpoint)}). Pass strict=False to skip missing keys.")
    modules = [obj for obj in state.values() if isinstance(obj, nn.Module)]
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        if isinstance(obj, nn.Module):
            strategy.load_module_state_dict(obj, checkpoint.pop(key), strict=strict)
        elif isinstance(obj, Optimizer):
            from fabriclite.checkpoint.dcp import load_optimizer_state

            load_optimizer_state(modules[0] if len(modules) == 1 else None, obj, checkpoint.pop(key))
        elif is_stateful(obj):
            obj.load_state_dict(checkpoint.pop(key))
        else:
            state[key] = checkpoint.pop(key)
    return checkpoint


def load_raw(strategy: Any, path: PathLike, obj: Union[nn.Module, Optimizer], strict: bool = True,
             weights_only: Optional[bool] = None) -> None:
    """Load a bare state_dict file (e.g. ``torch.save(model.state_dict(), path)``) into ``obj``."""
    if not isinstance(obj, (nn.Module, Optimizer)):
        raise TypeError(f"load_raw(path, obj): obj must be a torch.nn.Module or torch.optim.Optimizer; got "
                        f"{type(obj).__name__}.")
    load_checkpoint(strategy, path, obj, strict=strict, weights_only=weights_only)


__all__ = ["check_filter", "is_stateful", "load_checkpoint", "load_raw", "read", "restore_into", "save_checkpoint",
           "to_saveable"]
