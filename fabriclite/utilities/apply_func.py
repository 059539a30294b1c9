"""Lightning's ``lightning.fabric.utilities.apply_func`` path (re-export of fabriclite.training.device_transfer)."""
from fabriclite.training.device_transfer import move_data_to_device  # noqa: F401
