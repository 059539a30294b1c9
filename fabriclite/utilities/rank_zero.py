"""Lightning's ``lightning.fabric.utilities.rank_zero`` path (re-exports of fabriclite.compat.rank_zero_env)."""
from fabriclite.compat.rank_zero_env import rank_zero_deprecation  # noqa: F401
from fabriclite.compat.rank_zero_env import rank_zero_info  # noqa: F401
from fabriclite.compat.rank_zero_env import rank_zero_only  # noqa: F401
from fabriclite.compat.rank_zero_env import rank_zero_warn  # noqa: F401
