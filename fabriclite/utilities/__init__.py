"""Lightning's ``lightning.fabric.utilities`` import path: helpers user scripts call directly
(``rank_zero_only``, ``AttributeDict``, ``move_data_to_device``, ...).

Taking ``rank_zero_only`` (or a ``rank_zero_*`` message function) from this package gives it a rank from the
environment when none is set yet (RANK, LOCAL_RANK, SLURM_PROCID, JSM_NAMESPACE_RANK; else 0), as importing
Lightning's does; a strategy sets the real global rank when its rank joins the job. Importing the package
sets nothing.
"""
from typing import Any

from fabriclite.utilities.apply_func import move_data_to_device
from fabriclite.utilities.data import AttributeDict, suggested_max_num_workers
from fabriclite.utilities.distributed import is_shared_filesystem
from fabriclite.utilities.enums import LightningEnum
from fabriclite.utilities.throughput import Throughput, ThroughputMonitor, measure_flops
from fabriclite.utilities.warnings import PossibleUserWarning, disable_possible_user_warnings

__all__ = [
    "AttributeDict",
    "LightningEnum",
    "PossibleUserWarning",
    "Throughput",
    "ThroughputMonitor",
    "disable_possible_user_warnings",
    "is_shared_filesystem",
    "measure_flops",
    "move_data_to_device",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "suggested_max_num_workers",
]

_RANK_ZERO = ("rank_zero_deprecation", "rank_zero_info", "rank_zero_only", "rank_zero_warn")


def __getattr__(name: str) -> Any:
    if name in _RANK_ZERO:
        from fabriclite.compat.rank_zero_env import ensure_rank
        from fabriclite.utilities import rank_zero

        ensure_rank()
        return getattr(rank_zero, name)
    raise AttributeError(f"module 'fabriclite.utilities' has no attribute {name!r}")
