"""fabriclite: turn a plain PyTorch script into a distributed one with one object, ``Fabric``."""
from fabriclite.collectives.object_pickle import add_safe_globals
from fabriclite.fabric import Fabric
from fabriclite.training.seeding import seed_everything
from fabriclite.training.wrapping import is_wrapped

__version__ = "0.1.0.dev0"
__all__ = ["Fabric", "__version__", "add_safe_globals", "is_wrapped", "seed_everything"]
