"""The path docs/training.md gave ``DistributedSamplerWrapper`` (it lives in ``fabriclite.data.sampling``) and
``setup_dataloader`` (``fabriclite.training.module_setup``): one import line per module."""
from fabriclite.data.sampling import DistributedSamplerWrapper  # noqa: F401
from fabriclite.training.module_setup import setup_dataloader  # noqa: F401
