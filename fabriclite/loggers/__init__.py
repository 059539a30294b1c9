"""Experiment loggers for ``Fabric(loggers=[...])`` (Lightning Fabric's ``lightning.fabric.loggers``).

Importing this package does not import tensorboard; ``TensorBoardLogger`` imports it on first use.

May import: ``training`` and what lies below it. Entry points: ``CSVLogger``, ``TensorBoardLogger``.
"""
from fabriclite.loggers.base import Logger
from fabriclite.loggers.csv import CSVLogger
from fabriclite.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]
