"""Lightning's ``lightning.fabric.wrappers`` path: re-exports of fabriclite.training.wrapping (the wrappers
``Fabric.setup*`` return) and of the names Lightning's module exposes beside them."""
from fabriclite.precision import Precision  # noqa: F401
from fabriclite.strategies.base import Strategy  # noqa: F401
from fabriclite.training.device_transfer import move_data_to_device  # noqa: F401
from fabriclite.training.wrapping import FabricDataLoader  # noqa: F401
from fabriclite.training.wrapping import FabricModule  # noqa: F401
from fabriclite.training.wrapping import FabricOptimizer  # noqa: F401
from fabriclite.training.wrapping import is_wrapped  # noqa: F401
