"""Lightning's ``plugins`` import path: ``from fabriclite.plugins import SLURMEnvironment`` (re-exports only)."""

from fabriclite.plugins.environments import (
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
