"""Lightning's ``plugins`` import path: ``from fabriclite.plugins import SLURMEnvironment, MixedPrecision``
(re-exports only: the cluster environments and the precision plugins)."""

from fabriclite.plugins.environments import *  # noqa: F401,F403
from fabriclite.plugins.environments import __all__ as _environments
from fabriclite.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

__all__ = [*_environments, "DoublePrecision", "HalfPrecision", "MixedPrecision", "Precision"]
