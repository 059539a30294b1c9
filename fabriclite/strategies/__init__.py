"""Strategies: how processes cooperate. Pick one by name through ``STRATEGIES``.

Horovod and XLA strategies live in modules that import their backend only when used; importing
this package never imports horovod or torch_xla. FSDPStrategy and ModelParallelStrategy load on first use. The
torchft family (``fault_tolerant``, ``diloco``, ``local_sgd``: ``fabriclite run --fault-tolerant``) is the folder
``strategies.torchft``, named here only by strings; importing this package never imports torchft.

May import: ``checkpoint``, ``collectives``, ``launchers``, ``supervision``, ``accelerators``, ``environments``,
``precision``, ``distributed``. Never ``training``, ``fabric``, ``connector``. Entry points: ``create_strategy``,
``Strategy`` (set-up hooks and the flat collective primitives ``collectives`` builds on).
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, Tuple, Type

from fabriclite.strategies.base import Strategy
from fabriclite.strategies.ddp import DDPStrategy
from fabriclite.strategies.parallel import ParallelStrategy
from fabriclite.strategies.single_device import SingleDeviceStrategy

#: strategy name -> ("module:Class", constructor keyword arguments)
STRATEGIES: Dict[str, Tuple[str, Dict[str, Any]]] = {
    "ddp": ("fabriclite.strategies.ddp:DDPStrategy", {"start_method": "popen"}),
    "ddp_spawn": ("fabriclite.strategies.ddp:DDPStrategy", {"start_method": "spawn"}),
    "ddp_fork": ("fabriclite.strategies.ddp:DDPStrategy", {"start_method": "fork"}),
    "ddp_notebook": ("fabriclite.strategies.ddp:DDPStrategy", {"start_method": "fork"}),
    "ddp_find_unused_parameters_true": (
        "fabriclite.strategies.ddp:DDPStrategy", {"start_method": "popen", "find_unused_parameters": True}),
    "fault_tolerant": ("fabriclite.strategies.torchft.replica_strategy:FaultTolerantStrategy", {}),
    "diloco": ("fabriclite.strategies.torchft.diloco:DiLoCoStrategy", {}),
    "local_sgd": ("fabriclite.strategies.torchft.diloco:LocalSGDStrategy", {}),
    "fsdp": ("fabriclite.strategies.fsdp:FSDPStrategy", {}),
    "fsdp_cpu_offload": ("fabriclite.strategies.fsdp:FSDPStrategy", {"cpu_offload": True}),
    "single_device": ("fabriclite.strategies.single_device:SingleDeviceStrategy", {}),
    "horovod": ("fabriclite.strategies.horovod:HorovodStrategy", {}),
    "xla": ("fabriclite.strategies.xla:XLAStrategy", {}),
    "single_xla": ("fabriclite.strategies.xla:SingleDeviceXLAStrategy", {}),
}

#: SingleTPUStrategy: Lightning's legacy name of SingleDeviceXLAStrategy
_LAZY = {"HorovodStrategy": "horovod", "XLAStrategy": "xla", "SingleDeviceXLAStrategy": "single_xla",
         "SingleTPUStrategy": "single_xla", "FSDPStrategy": "fsdp", "DiLoCoStrategy": "diloco",
         "LocalSGDStrategy": "local_sgd"}
#: the strategies of ``fabriclite run --fault-tolerant`` (one torchft replica group per node): the per-step one and
#: the low-communication ones (fabriclite.strategies.torchft.diloco)
FAULT_TOLERANT = ("fault_tolerant", "diloco", "local_sgd")
#: classes without a registered name (Lightning registers none for ModelParallelStrategy)
_LAZY_CLASSES = {"ModelParallelStrategy": "fabriclite.strategies.model_parallel"}


def strategy_class(name: str) -> Type[Strategy]:
    """The class registered under ``name`` (a key of STRATEGIES)."""
    module, _, cls = STRATEGIES[name][0].partition(":")
    return getattr(importlib.import_module(module), cls)


def create_strategy(name: str, **kwargs: Any) -> Strategy:
    """An instance of the strategy registered under ``name``."""
    return strategy_class(name)(**{**STRATEGIES[name][1], **kwargs})


def __getattr__(name: str) -> Any:  # lazy: `from fabriclite.strategies import HorovodStrategy`
    if name in _LAZY:
        return strategy_class(_LAZY[name])
    if name in _LAZY_CLASSES:
        return getattr(importlib.import_module(_LAZY_CLASSES[name]), name)
    raise AttributeError(f"module 'fabriclite.strategies' has no attribute {name!r}")


__all__ = ["DDPStrategy", "FAULT_TOLERANT", "ParallelStrategy", "STRATEGIES", "SingleDeviceStrategy", "Strategy",
           "create_strategy", "strategy_class"]
