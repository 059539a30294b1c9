"""Cluster environments: where this process's ranks, world and main address come from.

Detection order (see :mod:`fabriclite.environments.detect`): forced instance (``plugins=[...]``) >
``FABRICLITE_CLUSTER_ENVIRONMENT=<name>`` > torchelastic > slurm > lsf > mpi > fabriclite children > env:// > local.
Importing this package reads nothing, writes nothing and imports no optional backend (torch_xla, mpi4py, horovod).

The rank a process has before it joins (Lightning's ``rank_zero_only`` rank): ``process_rank``.

May import: ``distributed`` only. Entry points: ``detect.detect_environment``, ``ENVIRONMENTS``.
"""

from fabriclite.environments.base import ClusterEnvironment
from fabriclite.environments.detect import (
    DETECTION_ORDER,
    ENVIRONMENTS,
    FORCE_ENVIRONMENT_VAR,
    detect_environment,
    detected_environments,
    environment_by_name,
)
from fabriclite.environments.env_var import EnvVarEnvironment, KubeflowEnvironment
from fabriclite.environments.fabriclite_env import FabricliteEnvironment
from fabriclite.environments.hostlist import expand_hostlist, first_host
from fabriclite.environments.local import LightningEnvironment, LocalEnvironment
from fabriclite.environments.lsf import LSFEnvironment
from fabriclite.environments.mpi import MPIEnvironment
from fabriclite.environments.slurm import SLURMEnvironment
from fabriclite.environments.torchelastic import TorchElasticEnvironment
from fabriclite.environments.xla import XLAEnvironment

__all__ = [
    "DETECTION_ORDER",
    "ENVIRONMENTS",
    "FORCE_ENVIRONMENT_VAR",
    "ClusterEnvironment",
    "EnvVarEnvironment",
    "FabricliteEnvironment",
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LightningEnvironment",
    "LocalEnvironment",
    "MPIEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "XLAEnvironment",
    "detect_environment",
    "detected_environments",
    "environment_by_name",
    "expand_hostlist",
    "first_host",
]
