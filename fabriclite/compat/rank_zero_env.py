"""The rank ``rank_zero_only`` starts with in a process that has not joined a job yet: Lightning gives it one from
the environment (``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``, ``JSM_NAMESPACE_RANK``; else 0). ``fabriclite.utilities``
calls ``ensure_rank`` when a ``rank_zero_*`` name is taken from it; ``Strategy.setup_environment`` sets the real
global rank when a rank joins."""
from __future__ import annotations

import os
from typing import Optional

from lightning_utilities.core.rank_zero import rank_zero_only

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
