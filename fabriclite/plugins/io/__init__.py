"""Lightning's ``lightning.fabric.plugins.io`` import path: ``from fabriclite.plugins.io import CheckpointIO``.

Re-exports :mod:`fabriclite.checkpoint.checkpoint_io` and :mod:`fabriclite.checkpoint.async_save`; nothing is
defined here.
"""

from fabriclite.checkpoint.async_save import AsyncCheckpointIO
from fabriclite.checkpoint.checkpoint_io import CheckpointIO
from fabriclite.checkpoint.checkpoint_io import TorchCheckpointIO

__all__ = ["AsyncCheckpointIO", "CheckpointIO", "TorchCheckpointIO"]
