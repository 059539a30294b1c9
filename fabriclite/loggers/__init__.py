"""Experiment loggers for ``Fabric(loggers=[...])`` (Lightning Fabric's ``lightning.fabric.loggers``).

Importing this package does not import tensorboard, nor the module of ``TensorBoardLogger`` (loaded when the name
is first taken), which imports tensorboard on first use.

May import: ``training`` and what lies below it. Entry points: ``CSVLogger``, ``TensorBoardLogger``.
"""
from typing import Any

from fabriclite.loggers.base import Logger
from fabriclite.loggers.csv import CSVLogger


def __getattr__(name: str) -> Any:  # lazy: `from fabriclite.loggers import TensorBoardLogger`
    if name == "TensorBoardLogger":
        from fabriclite.loggers.tensorboard import TensorBoardLogger

        return TensorBoardLogger
    raise AttributeError(f"module 'fabriclite.loggers' has no attribute {name!r}")


__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]
