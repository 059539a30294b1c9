"""Moving (nested) collections of tensors between devices."""
from __future__ import annotations

from abc import ABC
from typing import Any, Union

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor


class _Transferable(ABC):
    """Anything with a ``to(device)`` method (tensors, modules, user types) counts as transferable."""

    @classmethod
    def __subclasshook__(cls, subclass: Any) -> Any:
        return callable(getattr(subclass, "to", None)) or NotImplemented


def move_data_to_device(batch: Any, device: Union[str, int, torch.device]) -> Any:
    """``batch`` with every object that has a ``to(device)`` method (tensors, modules, ...) moved to ``device``,
    in the same nested structure (dicts, lists, tuples, namedtuples, dataclasses); everything else as is.
    Tensor copies to CUDA are non-blocking."""
    if isinstance(device, str):
        device = torch.device(device)

    def move(data: Any) -> Any:
        kwargs = {}
        if isinstance(data, Tensor) and isinstance(device, torch.device) and device.type not in ("cpu", "mps"):
            kwargs["non_blocking"] = True
        out = data.to(device, **kwargs)
        return data if out is None else out  # a user type whose to() forgot to return self

    return apply_to_collection(batch, dtype=_Transferable, function=move)
