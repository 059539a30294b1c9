"""Accelerators: what a device is. Pick one by name through ``ACCELERATORS``.

``"tpu"`` maps to the XLA accelerator, whose module imports torch_xla only when used. Peak FLOP/s per chip and
dtype (for model FLOPs utilisation): ``peak_flops``.

May import: ``distributed`` only (the floor below). Entry points: ``ACCELERATORS``, ``accelerator_class``.
"""
from __future__ import annotations

import importlib
from typing import Dict, Type

from fabriclite.accelerators.base import Accelerator
from fabriclite.accelerators.cpu import CPUAccelerator
from fabriclite.accelerators.cuda import CUDAAccelerator, find_usable_cuda_devices
from fabriclite.accelerators.mps import MPSAccelerator

#: accelerator name -> "module:Class" (loaded on first use, so optional backends stay unimported)
ACCELERATORS: Dict[str, str] = {
    "cpu": "fabriclite.accelerators.cpu:CPUAccelerator",
    "cuda": "fabriclite.accelerators.cuda:CUDAAccelerator",
    "gpu": "fabriclite.accelerators.cuda:CUDAAccelerator",
    "mps": "fabriclite.accelerators.mps:MPSAccelerator",
    "tpu": "fabriclite.accelerators.xla:XLAAccelerator",
}


def accelerator_class(name: str) -> Type[Accelerator]:
    """The class registered under ``name`` (a key of ACCELERATORS)."""
    module, _, cls = ACCELERATORS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def __getattr__(name: str):  # lazy: `from fabriclite.accelerators import XLAAccelerator`
    if name in ("XLAAccelerator", "TPUAccelerator"):  # TPUAccelerator: Lightning's legacy name
        return accelerator_class("tpu")
    raise AttributeError(f"module 'fabriclite.accelerators' has no attribute {name!r}")


__all__ = ["ACCELERATORS", "Accelerator", "CPUAccelerator", "CUDAAccelerator", "MPSAccelerator", "accelerator_class",
           "find_usable_cuda_devices"]
