"""Sharded (torch.distributed.checkpoint) and full checkpoints of sharded modules, in Lightning's layouts.

Sharded: a directory holding torch.distributed.checkpoint's ``.metadata`` and one ``__<rank>_0.distcp`` file per
rank, with the modules' and optimizers' state under their keys (``model.<param>``, ``optimizer.state.<param>.exp_avg``
... as ``get_model_state_dict`` / ``get_optimizer_state_dict`` name them), plus ``meta.pt``: everything else, written
by rank 0. This is what Lightning's ModelParallelStrategy (FSDP2) writes and reads.

Full: one ``torch.save`` file on rank 0; modules as full state_dicts, optimizers as full state keyed by parameter
name (Lightning's FSDP full format). Files whose optimizer state is keyed by index (DDP's) load too.

Writing goes through ``fabriclite.checkpoint.atomic``'s protocol: ``ShardedWriter.write(tmp)`` fills a temporary
directory on every rank, then rank 0 swaps it in (``fabriclite.checkpoint.async_save`` does the same in the
background, through torch.distributed.checkpoint's ``async_save``).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from torch import nn
from torch.optim import Optimizer

from fabriclite.checkpoint import safe_loading
from fabriclite.checkpoint.atomic import WriteErrors, write_file

METADATA_FILENAME = "meta.pt"
DCP_METADATA = ".metadata"


def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kwargs)


def is_sharded(module: Any) -> bool:
    """Whether ``module`` is an nn.Module holding DTensor parameters (FSDP2 / tensor parallel)."""
    from torch.distributed.tensor import DTensor

    return isinstance(module, nn.Module) and any(isinstance(p, DTensor) for p in module.parameters())


def is_sharded_checkpoint(path: str) -> bool:
    """A directory with ``meta.pt`` or torch.distributed.checkpoint's ``.metadata``."""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, METADATA_FILENAME))
                                    or os.path.isfile(os.path.join(path, DCP_METADATA)))


# ---------------------------------------------------------------------- full state
def full_module_state(module: nn.Module) -> Dict[str, Any]:
    """``module``'s full state_dict on the CPU, on global rank 0 (``{}`` elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(module: nn.Module, optimizer: Optimizer) -> Dict[str, Any]:
    """``optimizer``'s full state keyed by parameter name, on global rank 0 (``{}`` elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=_options(full_state_dict=True, cpu_offload=True))


def load_full_module_state(module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> None:
    """Load a full state_dict (every rank holds it) into a sharded or plain ``module``. With ``strict``, keys
    that do not match raise a KeyError naming them, before anything is loaded."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    expected = set(_plain(module).state_dict().keys())
    given = set(state_dict.keys())
    if strict and expected != given:
        raise KeyError(f"The checkpoint's model keys do not match the module's: missing {sorted(expected - given)}, "
                       f"unexpected {sorted(given - expected)}. Pass strict=False to load the matching ones.")
    state = {k: v for k, v in state_dict.items() if k in expected}
    set_model_state_dict(module, state, options=_options(full_state_dict=True, strict=strict))


def load_optimizer_state(module: Optional[nn.Module], optimizer: Optimizer, state: Dict[str, Any]) -> None:
    """Load a full optimizer state into ``optimizer`` (of ``module``, sharded or not): keyed by parameter name
    (FSDP full files) or by index (DDP files)."""
    keyed_by_name = _keyed_by_name(state)
    if module is None or not (keyed_by_name or is_sharded(module)):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not keyed_by_name:
        state = _index_to_name(state, optimizer, module)
    set_optimizer_state_dict(module, optimizer, state, options=_options(full_state_dict=True))


def _keyed_by_name(state: Mapping[str, Any]) -> bool:
    params = [p for g in state.get("param_groups", []) for p in g.get("params", [])]
    return any(isinstance(p, str) for p in params) or any(isinstance(k, str) for k in state.get("state", {}))


def _plain(module: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def _index_to_name(state: Dict[str, Any], optimizer: Optimizer, module: nn.Module) -> Dict[str, Any]:
    names = {id(p): n for n, p in _plain(module).named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    saved = [i for g in state["param_groups"] for i in g["params"]]
    if len(saved) != len(order):
        raise ValueError(f"The checkpoint's optimizer state has {len(saved)} parameters; this optimizer has "
                         f"{len(order)}.")
    rename = dict(zip(saved, order))
    return {"state": {rename[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [rename[i] for i in g["params"]]} for g in state["param_groups"]]}


# ---------------------------------------------------------------------- sharded writing
class ShardedWriter:
    """Writes a sharded checkpoint into a (temporary) directory; run ``write`` on every rank."""

    directory = True

    def __init__(self, tensors: Dict[str, Any], metadata: Dict[str, Any], is_global_zero: bool,
                 no_dist: bool) -> None:
        self.tensors, self.metadata = tensors, metadata
        self.is_global_zero, self.no_dist = is_global_zero, no_dist

    @classmethod
    def from_state(cls, strategy: Any, state: Mapping[str, Any], filter: Optional[Mapping[str, Any]]) -> "ShardedWriter":
        """Modules and optimizers as their sharded state (one sharded module per checkpoint, as in Lightning);
        everything else (state_dicts of stateful objects) goes to ``meta.pt``."""
        if filter:
            raise NotImplementedError("filter= with state_dict_type='sharded' is not supported (a sharded checkpoint "
                                      "cannot be loaded partially); use state_dict_type='full' to save filtered state.")
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        module = _one_module(state, "save")
        tensors: Dict[str, Any] = {}
        metadata: Dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                tensors[key] = get_model_state_dict(obj)
            elif isinstance(obj, Optimizer):
                tensors[key] = get_optimizer_state_dict(module, obj)
            elif _stateful(obj):
                metadata[key] = obj.state_dict()
            else:
                metadata[key] = obj
        return cls(tensors, metadata, strategy.is_global_zero, strategy.world_size == 1)

    def write(self, directory: str, named: str = "") -> None:
        """Every rank's shards into ``directory`` (``meta.pt`` from global rank 0). A write that failed with an
        OSError raises one naming ``named`` (the checkpoint's own path; default ``directory``) and the cause."""
        from torch.distributed import checkpoint as dcp

        os.makedirs(directory, exist_ok=True)
        writer, errors = storage_writer(directory)
        try:
            dcp.save(self.tensors, checkpoint_id=directory, storage_writer=writer, no_dist=self.no_dist)
        except BaseException as err:  # noqa: BLE001 - torch.distributed.checkpoint's errors are BaseExceptions
            errors.raise_recorded(named or directory, err)
            raise
        self.write_metadata(self.metadata, directory, named)

    def write_metadata(self, metadata: Dict[str, Any], directory: str, named: str = "") -> None:
        """``meta.pt`` (``metadata``) into ``directory``, flushed and fsynced; on global rank 0 only. An OSError
        is raised naming ``named`` (default ``directory``) and the cause."""
        if self.is_global_zero:
            path = os.path.join(directory, METADATA_FILENAME)
            try:
                write_file(metadata, path)
            except OSError as err:
                errors = WriteErrors()
                errors.note(err, path)
                errors.raise_recorded(named or directory, err)
                raise


def storage_writer(directory: str) -> Tuple[Any, WriteErrors]:
    """torch.distributed.checkpoint's FileSystemWriter for ``directory`` whose files keep the OSError of a failed
    write (``WriteErrors``: DCP's own error would say ``unexpected pos`` instead of ``No space left on device``)."""
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(directory)
    errors = WriteErrors()
    create_stream = writer.fs.create_stream

    @contextmanager
    def recording(path: Any, mode: str) -> Iterator[Any]:
        try:  # opening and the closing flush fail too (a small shard reaches the disk only there)
            with create_stream(path, mode) as stream:
                yield errors.wrap(stream, os.fspath(path))
        except OSError as err:
            errors.note(err, os.fspath(path))
            raise

    writer.fs.create_stream = recording
    return writer, errors


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)) \
        and not isinstance(obj, type)


def _one_module(state: Mapping[str, Any], what: str) -> Optional[nn.Module]:
    modules = [obj for obj in state.values() if isinstance(obj, nn.Module)]
    if len(modules) > 1:
        raise ValueError(f"A sharded checkpoint holds one model; the state to {what} has {len(modules)} "
                         "(keys " + ", ".join(repr(k) for k, v in state.items() if isinstance(v, nn.Module)) +
                         "). Save each model to its own path.")
    return modules[0] if modules else None


# ---------------------------------------------------------------------- sharded reading
def reader(path: str, trusted: bool = False) -> Any:
    """DCP's reader of the folder ``path``: one that reads ``.metadata`` without running code
    (``safe_loading.safe_reader``) unless the caller ``trusted`` the folder (``weights_only=False``)."""
    if not trusted:
        return safe_loading.safe_reader(path)
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(path)


def check_complete(path: str, trusted: bool = False) -> None:
    """FileNotFoundError listing every file the sharded checkpoint at ``path`` needs but lacks (its metadata,
    a rank's shard file, ``meta.pt``). Reads only the small metadata file (see ``reader`` for ``trusted``)."""
    missing: List[str] = []
    if not os.path.isfile(os.path.join(path, DCP_METADATA)):
        missing.append(DCP_METADATA)
    else:
        storage = reader(path, trusted).read_metadata().storage_data or {}
        files = sorted({getattr(info, "relative_path", None) for info in storage.values()} - {None})
        missing += [f for f in files if not os.path.isfile(os.path.join(path, f))]
    if not os.path.isfile(os.path.join(path, METADATA_FILENAME)):
        missing.append(METADATA_FILENAME)
    if missing:
        raise FileNotFoundError(f"The sharded checkpoint {path} is incomplete: missing {missing}. Nothing was loaded; "
                                "copy the missing files from where the checkpoint was written (every rank's shard "
                                "must be on a filesystem this rank reads).")


def _check_keys(path: str, modules: Mapping[str, Mapping[str, Any]], trusted: bool) -> None:
    """KeyError naming the model keys the checkpoint lacks (strict loading), before anything is read."""
    stored = set(reader(path, trusted).read_metadata().state_dict_metadata)
    missing = sorted(f"{key}.{name}" for key, sd in modules.items() for name in sd if f"{key}.{name}" not in stored)
    if missing:
        raise KeyError(f"The checkpoint {path} lacks keys the model has: {missing[:8]}"
                       f"{' ...' if len(missing) > 8 else ''} ({len(missing)} in all). Nothing was loaded; pass "
                       "strict=False to load only the keys both have.")


def consolidate(path: str, weights_only: Optional[bool] = None) -> Dict[str, Any]:
    """The whole sharded checkpoint at ``path`` as one dict of full tensors on the CPU (``meta.pt``'s entries
    included), read by this process alone: what ``fabriclite consolidate`` writes. Unless ``weights_only`` is
    False (a folder you trust), nothing read runs code: ``.metadata`` through the restricted unpickler, the byte
    items and ``meta.pt`` with ``weights_only=True`` (``fabriclite.checkpoint.safe_loading``)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    safe = safe_loading.resolve_weights_only(weights_only)
    safe_loading.warn_vulnerable_torch()
    check_complete(path, trusted=not safe)
    checkpoint: Dict[str, Any] = {}
    with safe_loading.refusals_named(path):
        _load_state_dict(checkpoint, storage_reader=reader(path, not safe), planner=_planner(safe, empty=True),
                         no_dist=True)
    checkpoint.update(safe_loading.torch_load(os.path.join(path, METADATA_FILENAME), "cpu", safe))
    return checkpoint


def _planner(safe: bool, empty: bool = False, **kwargs: Any) -> Any:
    """DCP's load planner; ``safe``: one whose byte items load with ``weights_only=True``."""
    if safe:
        return safe_loading.safe_planner(empty, **kwargs)
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    return (_EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner)(**kwargs)


def load_sharded(strategy: Any, path: str, state: Any, strict: bool = True,
                 weights_only: Optional[bool] = None) -> Dict[str, Any]:
    """Restore ``state`` (a dict: one module, its optimizers, other objects) from the sharded checkpoint at
    ``path`` into a sharded or plain run of any world size; returns ``meta.pt``'s entries not requested.
    ``state`` None / empty: the whole checkpoint consolidated. A module alone: its weights. ``weights_only`` as
    for ``consolidate``."""
    safe = safe_loading.resolve_weights_only(weights_only)
    check_complete(path, trusted=not safe)
    if not state:
        return consolidate(path, safe)
    if isinstance(state, nn.Module):
        state = {"model": state}
    if isinstance(state, Optimizer):
        raise TypeError("Loading an optimizer alone from a sharded checkpoint is not supported; pass "
                        "state={'model': model, 'optimizer': optimizer}.")
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    module = _one_module(state, "load")
    no_dist = strategy.world_size == 1
    metadata = safe_loading.torch_load(os.path.join(path, METADATA_FILENAME), "cpu", safe)
    requested = [k for k, v in state.items() if not isinstance(v, (nn.Module, Optimizer))]
    absent = [k for k in requested if k not in metadata]
    if strict and absent:
        raise KeyError(f"The requested state contains key {absent[0]!r}, which is not in the checkpoint {path} "
                       f"(meta.pt has {sorted(metadata)}). Pass strict=False to skip missing keys.")
    target: Dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            target[key] = get_model_state_dict(obj)
        elif isinstance(obj, Optimizer):
            if module is None:
                raise ValueError("Loading an optimizer from a sharded checkpoint needs its model in the same state.")
            target[key] = get_optimizer_state_dict(module, obj)
    if strict:
        _check_keys(path, {key: target[key] for key, obj in state.items() if isinstance(obj, nn.Module)}, not safe)
    with safe_loading.refusals_named(path):
        dcp.load(target, checkpoint_id=path, storage_reader=reader(path, not safe),
                 planner=_planner(safe, allow_partial_load=not strict), no_dist=no_dist)
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            set_model_state_dict(obj, target[key], options=_options(strict=strict))
        elif isinstance(obj, Optimizer):
            set_optimizer_state_dict(module, obj, target[key])
    for key in requested:
        if key not in metadata:
            continue
        if _stateful(state[key]):
            state[key].load_state_dict(metadata.pop(key))
        else:
            state[key] = metadata.pop(key)
    return metadata


__all__ = ["METADATA_FILENAME", "ShardedWriter", "check_complete", "consolidate", "full_module_state",
           "full_optimizer_state", "is_sharded", "is_sharded_checkpoint", "load_full_module_state",
           "load_optimizer_state", "load_sharded"]
