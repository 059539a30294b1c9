"""Lightning's ``lightning.fabric.utilities.warnings`` path (re-exports of fabriclite.compat.user_warnings)."""
from fabriclite.compat.user_warnings import PossibleUserWarning  # noqa: F401
from fabriclite.compat.user_warnings import disable_possible_user_warnings  # noqa: F401
