"""``rank_zero_only`` and the rank-zero messages: lightning_utilities' own functions (the ones Lightning
re-exports), so a script mixing both sees one rank. ``ensure_rank`` gives ``rank_zero_only`` a rank from the
environment when it has none (``fabriclite.utilities`` calls it when these are taken from it);
``Strategy.setup_environment`` sets the global rank when a rank joins."""
from __future__ import annotations

import os
from typing import Optional

from lightning_utilities.core.rank_zero import (  # noqa: F401  (re-exported)
    rank_zero_deprecation,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)

#: environment variables that carry a process's rank, in the order Lightning reads them
RANK_ENV_VARS = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def rank_from_env() -> Optional[int]:
    """The rank the environment gives this process (the first of RANK_ENV_VARS that is set), or None."""
    for key in RANK_ENV_VARS:
        value = os.environ.get(key)
        if value is not None:
            return int(value)
    return None


def ensure_rank() -> None:
    """Set ``rank_zero_only.rank`` from the environment (else 0) unless something set it already."""
    if getattr(rank_zero_only, "rank", None) is None:
        rank_zero_only.rank = rank_from_env() or 0  # type: ignore[attr-defined]
