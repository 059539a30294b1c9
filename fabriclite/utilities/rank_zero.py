"""Lightning's ``lightning.fabric.utilities.rank_zero`` path: lightning_utilities' own functions (the ones Lightning
re-exports), so a script mixing both sees one rank. The rank they start with: fabriclite.compat.rank_zero_env."""
from lightning_utilities.core.rank_zero import rank_zero_deprecation  # noqa: F401
from lightning_utilities.core.rank_zero import rank_zero_info  # noqa: F401
from lightning_utilities.core.rank_zero import rank_zero_only  # noqa: F401
from lightning_utilities.core.rank_zero import rank_zero_warn  # noqa: F401
