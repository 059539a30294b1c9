"""Lightning's ``plugins`` import path: ``from fabriclite.plugins import SLURMEnvironment`` (re-exports only)."""

from fabriclite.plugins.environments import *  # noqa: F401,F403
from fabriclite.plugins.environments import __all__  # noqa: F401
