"""Lightning's ``lightning.fabric.utilities`` import path: helpers user scripts call directly
(``rank_zero_only``, ``AttributeDict``, ``move_data_to_device``, ...).

``rank_zero_only`` and the ``rank_zero_*`` message functions get a rank from the environment on first use when none
is set yet (RANK, LOCAL_RANK, SLURM_PROCID, JSM_NAMESPACE_RANK; else 0), as importing Lightning's does, from this
package and from ``.rank_zero`` alike (fabriclite.compat.rank_zero_env); importing sets nothing.
"""
from fabriclite.utilities.apply_func import move_data_to_device
from fabriclite.utilities.data import AttributeDict, suggested_max_num_workers
from fabriclite.utilities.distributed import is_shared_filesystem
from fabriclite.utilities.enums import LightningEnum
from fabriclite.utilities.rank_zero import rank_zero_deprecation, rank_zero_info, rank_zero_only, rank_zero_warn
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
