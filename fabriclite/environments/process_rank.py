"""The rank a process has before it joins a job, as Lightning's ``rank_zero_only`` sees it: lightning_utilities'
``rank_zero_only.rank`` (one value shared by fabriclite, Lightning and lightning_utilities), given on first use from
``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``, ``JSM_NAMESPACE_RANK`` (Lightning's order; else 0) when nothing set it.
A strategy sets the real global rank when its rank joins. Importing this module sets nothing."""
from __future__ import annotations

import os
from typing import Any, Optional

#: environment variables that carry a process's rank, in the order Lightning reads them
RANK_ENV_VARS = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def rank_from_env() -> Optional[int]:
    """The rank the environment gives this process (the first of RANK_ENV_VARS that is set), or None.
    ValueError naming the variable for a value that is not an int."""
    for key in RANK_ENV_VARS:
        value = os.environ.get(key)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"${key}={value!r}: expected an int (the rank of this process).") from None
    return None


def shared_rank_zero_only() -> Any:
    """lightning_utilities' ``rank_zero_only`` (imported on first use: ``import fabriclite`` stays light)."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    return rank_zero_only


def ensure_rank() -> None:
    """Set ``rank_zero_only.rank`` from the environment (else 0) unless something set it already."""
    shared = shared_rank_zero_only()
    if getattr(shared, "rank", None) is None:
        shared.rank = rank_from_env() or 0


def current_rank() -> int:
    """The rank ``rank_zero_only`` decides with (given from the environment first when nothing set it)."""
    ensure_rank()
    return shared_rank_zero_only().rank


def set_rank(rank: int) -> None:
    """Make ``rank`` the one ``rank_zero_only`` decides with (a process that now knows its global rank)."""
    shared_rank_zero_only().rank = rank
