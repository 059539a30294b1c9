"""Checkpoints that run no code: how fabriclite reads every checkpoint file unless the caller trusts it.

- ``resolve_weights_only(value)``: what a load uses. ``None`` (the default of ``fabric.load``, ``load_latest``,
  ``load_raw``, ``fabriclite consolidate``) becomes ``True``, passed to ``torch.load`` explicitly, so torch's
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (which flips only an unset argument) does not turn it off; only the
  caller's own ``False`` does.
- ``torch_load``: ``torch.load`` with that rule, the classes ``fabriclite.add_safe_globals`` allowed added to
  torch's safe globals for this load only (``torch.serialization.safe_globals``; nothing is registered at import).
- torch.distributed.checkpoint (DCP) folders: ``SafeFileSystemReader`` reads ``.metadata`` (a plain pickle) with
  fabriclite's restricted unpickler, DCP's metadata classes added; ``SafeLoadPlanner`` /
  ``SafeEmptyStateDictLoadPlanner`` read the ``.distcp`` files' byte items with ``torch.load(weights_only=True)``
  (DCP's ``DefaultLoadPlanner.load_bytes`` uses ``weights_only=False``). The tensors DCP reads itself already
  load with ``weights_only=True``.
- ``warn_vulnerable_torch``: on torch < 2.10, one warning naming CVE-2026-24747 (memory corruption in the
  weights-only unpickler, fixed in torch 2.10.0) and the upgrade.

May import: ``fabriclite.collectives`` (the restricted unpickler) and torch.
"""
from __future__ import annotations

import io
import os
import pickle
import re
import warnings
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from fabriclite.collectives.object_pickle import SafeUnpickler, user_safe_globals

#: the first torch whose weights-only unpickler has the fix for CVE-2026-24747
FIXED_TORCH = (2, 10)
_warned = False


def resolve_weights_only(value: Optional[bool]) -> bool:
    """The ``weights_only`` a load uses: ``value``, or True for None. TypeError for anything but None or a bool."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise TypeError(f"weights_only={value!r}: expected True, False or None (None means True: tensors, containers "
                        "and primitives only; pass False only for a file you trust, since loading it runs any code "
                        "it holds).")
    return value


def vulnerable_torch_message(version: str) -> Optional[str]:
    """The warning for torch ``version`` (``"2.9.1+cpu"``) when its weights-only unpickler has CVE-2026-24747."""
    try:
        major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    if (major, minor) >= FIXED_TORCH:
        return None
    return (f"torch {version} has CVE-2026-24747: memory corruption in torch.load's weights-only unpickler, which "
            "fabriclite uses to read checkpoints, so a crafted checkpoint can still run code. Upgrade to "
            "torch>=2.10.0 (pip install -U 'torch>=2.10'), or load only checkpoints you trust.")


def warn_vulnerable_torch() -> None:
    """Warn once per process when this torch has CVE-2026-24747 (see ``vulnerable_torch_message``)."""
    global _warned
    if _warned:
        return
    _warned = True
    message = vulnerable_torch_message(torch.__version__)
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=3)


def torch_load(f: Any, map_location: Any = None, weights_only: Optional[bool] = None, **kwargs: Any) -> Any:
    """``torch.load(f, map_location, weights_only=resolve_weights_only(weights_only))``; a weights-only load also
    accepts the classes ``fabriclite.add_safe_globals`` allowed."""
    safe = resolve_weights_only(weights_only)
    if not safe:
        return torch.load(f, map_location=map_location, weights_only=False, **kwargs)
    extra = user_safe_globals()
    if not extra:
        return torch.load(f, map_location=map_location, weights_only=True, **kwargs)
    with torch.serialization.safe_globals(extra):
        return torch.load(f, map_location=map_location, weights_only=True, **kwargs)


# ---------------------------------------------------------------------- torch.distributed.checkpoint
def _dcp_classes() -> Dict[Tuple[str, str], Any]:
    """The classes DCP's ``.metadata`` pickle names, beyond the restricted unpickler's defaults."""
    from torch.distributed.checkpoint import filesystem, metadata

    names = {metadata: ("Metadata", "StorageMeta", "MetadataIndex", "TensorProperties", "TensorStorageMetadata",
                        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"),
             filesystem: ("_StorageInfo",)}
    return {(module.__name__, name): getattr(module, name) for module, names_ in names.items()
            for name in names_ if hasattr(module, name)}


def _refusal(module: str, name: str) -> str:
    return (f"fabriclite refused to unpickle {module}.{name} from a torch.distributed.checkpoint .metadata file: it is "
            "not a class DCP writes there, and loading it could run code. If the folder is yours, load it with "
            "weights_only=False (fabriclite consolidate --trusted).")


def read_dcp_metadata(path: str) -> Any:
    """The ``Metadata`` of the DCP folder at ``path``'s ``.metadata`` (or ``__<rank>.metadata``), read with the
    restricted unpickler; ``pickle.UnpicklingError`` naming a global that is not DCP's."""
    with open(path, "rb") as f:
        return SafeUnpickler(f, _dcp_classes(), _refusal).load()


def _safe_bytes(value: io.BytesIO) -> Any:
    return torch_load(value, weights_only=True)


@contextmanager
def refusals_named(path: str) -> Iterator[None]:
    """Inside: a DCP load of the folder ``path``. A refusal of the restricted unpickler or of
    ``weights_only=True`` that DCP wrapped in its ``CheckpointException`` (a BaseException) comes out as a
    ``pickle.UnpicklingError`` naming the folder and the way to load a folder you trust."""
    try:
        yield
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        failures = getattr(err, "failures", None) if type(err).__name__ == "CheckpointException" else None
        found = [f[0] if isinstance(f, tuple) else f for f in (failures or {}).values()]
        refused = next((f for f in found if isinstance(f, pickle.UnpicklingError)), None)
        if refused is None:
            raise
        detail = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(refused))
        text = detail.group(1) if detail else str(refused).strip().splitlines()[0]
        raise pickle.UnpicklingError(
            f"the sharded checkpoint {path} holds an item whose loading would run code, so it was refused: {text} "
            "Nothing was restored. If the folder is yours, load it with weights_only=False (fabriclite consolidate "
            "--trusted).") from err


def safe_reader(path: str) -> Any:
    """A DCP ``FileSystemReader`` for ``path`` whose ``read_metadata`` runs no code (``read_dcp_metadata``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """``FileSystemReader`` that reads ``.metadata`` with fabriclite's restricted unpickler."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(os.fspath(self._get_metadata_path(kwargs.get("rank"))))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(path)


def safe_planner(empty: bool = False, **kwargs: Any) -> Any:
    """DCP's ``DefaultLoadPlanner(**kwargs)`` (``empty``: ``_EmptyStateDictLoadPlanner``, which rebuilds the whole
    state from the metadata) whose byte items load with ``torch.load(weights_only=True)``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    base = _EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner

    class SafeLoadPlanner(base):  # type: ignore[misc, valid-type]
        """The planner whose ``load_bytes`` reads each non-tensor item with ``weights_only=True``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = _safe_bytes(value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner(**kwargs)


__all__ = ["FIXED_TORCH", "read_dcp_metadata", "refusals_named", "resolve_weights_only", "safe_planner", "safe_reader",
           "torch_load", "vulnerable_torch_message", "warn_vulnerable_torch"]
