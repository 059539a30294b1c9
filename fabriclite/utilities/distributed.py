"""Lightning's ``lightning.fabric.utilities.distributed`` path (re-export of fabriclite.distributed.shared_filesystem)."""
from fabriclite.distributed.shared_filesystem import is_shared_filesystem  # noqa: F401
