"""Lightning's import path for cluster environments: ``from fabriclite.plugins.environments import SLURMEnvironment``.

Re-exports :mod:`fabriclite.environments`; nothing is defined here.
"""

from fabriclite.environments import (
    ClusterEnvironment,
    EnvVarEnvironment,
    FabricliteEnvironment,
    KubeflowEnvironment,
    LightningEnvironment,
    LocalEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    XLAEnvironment,
)

__all__ = [
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
]
