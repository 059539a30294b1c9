"""Lightning's CheckpointIO plugin API: how a one-file checkpoint is written and read.

``Fabric(plugins=[MyCheckpointIO()])`` (or ``DDPStrategy(checkpoint_io=...)``) puts a plugin in
``fabric.strategy.checkpoint_io``; every one-file checkpoint then goes through it: ``fabric.save`` (with or without
``keep=``), ``fabric.load``, ``load_latest``, and the deletion of the checkpoints ``keep=`` drops. Global rank 0
calls ``save_checkpoint`` with the final name and the state already turned into state_dicts; every rank calls
``load_checkpoint``. A plugin has no rename, lock or directory listing, so what is atomic is its business, and
with ``keep=`` fabriclite writes the manifest (the commit point) after the plugin returned. Sharded strategies
write torch.distributed.checkpoint directories and take no plugin (as in Lightning).

``TorchCheckpointIO`` (the default) writes with ``torch.save`` through fabriclite's atomic protocol on local
paths (temporary name beside the target, fsync, rename, directory fsync) and with one upload on fsspec URLs,
and reads with ``torch.load(weights_only=True)`` unless told ``False``; a file that cannot be read is a
``CorruptCheckpointError`` naming it.
"""
from __future__ import annotations

import os
import pickle
import re
from abc import ABC, abstractmethod
from typing import Any, Callable, Dict, Optional, Union

import torch

from fabriclite.checkpoint import remote_paths
from fabriclite.checkpoint.atomic import atomic_save, remove_path
from fabriclite.checkpoint.integrity import CorruptCheckpointError
from fabriclite.checkpoint.safe_loading import torch_load
from fabriclite.distributed import rendezvous

PathLike = Union[str, "os.PathLike[str]"]
#: torch's weights-only unpickler refusing a global or a class the file names (an unknown opcode is read as damage:
#: garbage bytes look like one)
_REFUSED = re.compile(r"Unsupported (global|class)|unrecognized function|Can only build")


class CheckpointIO(ABC):
    """How checkpoint files are written, read and removed (Lightning's ``CheckpointIO`` interface).

    Subclass it and pass an instance to ``Fabric(plugins=[...])``: global rank 0 calls ``save_checkpoint`` with
    the final path; every rank calls ``load_checkpoint``; ``remove_checkpoint`` deletes a checkpoint that
    ``save(..., keep=K)`` no longer keeps; ``teardown`` runs when the strategy is torn down.
    """

    @abstractmethod
    def save_checkpoint(self, checkpoint: Dict[str, Any], path: PathLike, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` (a dict of state_dicts and plain values) to ``path``; ``storage_options`` is what
        the caller passed to ``Strategy.save_checkpoint``."""

    @abstractmethod
    def load_checkpoint(self, path: PathLike, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """The checkpoint stored at ``path``. ``map_location`` as in ``torch.load``; ``weights_only`` None means
        True (tensors, containers and primitives only): fabriclite passes True or the caller's False."""

    @abstractmethod
    def remove_checkpoint(self, path: PathLike) -> None:
        """Delete the checkpoint at ``path``."""

    def teardown(self) -> None:
        """Called when the strategy is torn down (end of the job)."""


def _saved_location(storage: Any, location: str) -> Any:
    """``torch.load``'s map_location that keeps every storage where it was saved (Lightning's default)."""
    return storage


class TorchCheckpointIO(CheckpointIO):
    """``torch.save`` / ``torch.load``, atomic on local paths, one upload on fsspec URLs (see the module
    docstring)."""

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: PathLike, storage_options: Optional[Any] = None) -> None:
        """Write ``checkpoint`` to ``path`` such that ``path`` holds either its previous content or all of the new
        one (local paths; a URL is one upload). TypeError for ``storage_options`` (this plugin has none), as in
        Lightning; OSError naming ``path`` and the cause when the write fails (nothing is left behind then)."""
        self.check_storage_options(storage_options)
        target = remote_paths.normalize(path)
        try:
            if remote_paths.is_remote(target):
                _upload(checkpoint, target)
            else:
                atomic_save(checkpoint, target, tmp_tag=rendezvous.run_id())
        except OSError as err:
            raise type(err)(err.errno, f"Saving the checkpoint {target} failed: {err.strerror or err}; the previous "
                                       "file at that path (if any) is intact and no temporary file is left.") \
                from err

    def check_storage_options(self, storage_options: Optional[Any]) -> None:
        """Lightning's TypeError when ``storage_options`` is given: this plugin has none."""
        if storage_options is not None:
            raise TypeError(
                "`Trainer.save_checkpoint(..., storage_options=...)` with `storage_options` arg"
                f" is not supported for `{self.__class__.__name__}`. Please implement your custom `CheckpointIO`"
                " to define how you'd like to use `storage_options`.")

    def load_checkpoint(self, path: PathLike, map_location: Optional[Callable] = _saved_location,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """``torch.load`` of ``path``. FileNotFoundError naming it when it does not exist; CorruptCheckpointError
        (a RuntimeError) naming it when it cannot be read (truncated, damaged, not a torch file). ``weights_only``
        None is True, also under ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (``fabriclite.checkpoint.safe_loading``);
        pass False only for a file you trust. A file refused by ``weights_only=True`` raises torch's own error,
        which says how to allow it."""
        target = remote_paths.normalize(path)
        if not remote_paths.exists(target) or remote_paths.isdir(target):
            raise FileNotFoundError(f"Checkpoint file not found: {target}")
        try:
            if remote_paths.is_remote(target):
                fs, inner = remote_paths.filesystem(target)
                with fs.open(inner, "rb") as f:
                    return torch_load(f, map_location, weights_only)
            return torch_load(target, map_location, weights_only)
        except pickle.UnpicklingError as err:
            if _REFUSED.search(str(err)):  # weights_only refused what the file asks for: torch's message says why
                raise
            raise CorruptCheckpointError(target, _describe(err)) from err
        except (RuntimeError, EOFError, OSError, KeyError, ValueError, UnicodeDecodeError, IndexError) as err:
            if isinstance(err, FileNotFoundError):
                raise
            raise CorruptCheckpointError(target, _describe(err)) from err

    def remove_checkpoint(self, path: PathLike) -> None:
        """Delete the file (or directory) at ``path``; nothing when it does not exist."""
        target = remote_paths.normalize(path)
        if remote_paths.is_remote(target):
            remote_paths.remove(target)
        else:
            remove_path(target)


def _upload(checkpoint: Dict[str, Any], url: str) -> None:
    fs, inner = remote_paths.filesystem(url)
    fs.makedirs(os.path.dirname(inner), exist_ok=True)
    with fs.open(inner, "wb") as f:
        torch.save(checkpoint, f)


def _describe(err: BaseException) -> str:
    found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(err))  # torch's weights_only wrapping
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    text = (found.group(1) if found else lines[0] if lines else repr(err))[:200].rstrip(".")
    return (f"{type(err).__name__}: {text}. The file is truncated, damaged or not a file torch.save wrote; load an "
            "older checkpoint (fabric.load_latest falls back to one by itself).")


__all__ = ["CheckpointIO", "TorchCheckpointIO"]
