"""Lightning's ``lightning.fabric.utilities.data`` path (re-exports of fabriclite.training.data_helpers)."""
from fabriclite.training.data_helpers import AttributeDict  # noqa: F401
from fabriclite.training.data_helpers import suggested_max_num_workers  # noqa: F401
