"""Lightning's ``plugins`` import path: ``from fabriclite.plugins import SLURMEnvironment, MixedPrecision,
CheckpointIO`` (re-exports only: the cluster environments, the precision plugins, the checkpoint IO plugins)."""

from fabriclite.plugins.environments import *  # noqa: F401,F403
from fabriclite.plugins.environments import __all__ as _environments
from fabriclite.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO
from fabriclite.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

__all__ = [*_environments, "AsyncCheckpointIO", "CheckpointIO", "DoublePrecision", "HalfPrecision", "MixedPrecision",
           "Precision", "TorchCheckpointIO"]
