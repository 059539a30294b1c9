"""``rank_zero_only`` and the ``rank_zero_*`` message functions of Lightning's ``lightning.fabric.utilities`` (and
``.utilities.rank_zero``) paths, with the rank they start with in a process that has not joined a job yet.

They run lightning_utilities' own functions (the ones Lightning re-exports), so a script mixing fabriclite, Lightning
and lightning_utilities sees one rank: ``rank_zero_only.rank`` here reads and writes lightning_utilities'. Lightning
gives that rank a value when ``lightning.fabric`` is imported; fabriclite gives it on first use (importing sets
nothing), from the same variables in the same order (fabriclite.environments.process_rank).
``Strategy.setup_environment`` sets the real global rank when a rank joins.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional, TypeVar, Union

from fabriclite.environments.process_rank import current_rank, ensure_rank, set_rank, shared_rank_zero_only

T = TypeVar("T")


class _RankZeroOnly:
    """``rank_zero_only(fn, default=None)``: ``fn`` runs on global rank 0 only; elsewhere the call returns
    ``default``. ``rank_zero_only.rank`` is the rank it decides with (lightning_utilities', given from the
    environment on first use)."""

    def __call__(self, fn: Callable[..., T], default: Optional[T] = None) -> Callable[..., Optional[T]]:
        decorated = shared_rank_zero_only()(fn, default)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Optional[T]:
            ensure_rank()
            return decorated(*args, **kwargs)

        return call

    @property
    def rank(self) -> int:
        return current_rank()

    @rank.setter
    def rank(self, value: int) -> None:
        set_rank(value)

    def __repr__(self) -> str:
        return "rank_zero_only"


rank_zero_only = _RankZeroOnly()


def rank_zero_info(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """Log ``args`` at info level on global rank 0 only."""
    ensure_rank()
    _shared().rank_zero_info(*args, stacklevel=stacklevel + 1, **kwargs)


def rank_zero_warn(message: Union[str, Warning], stacklevel: int = 4, **kwargs: Any) -> None:
    """``warnings.warn(message, **kwargs)`` on global rank 0 only (pointing at the caller)."""
    ensure_rank()
    _shared().rank_zero_warn(message, stacklevel=stacklevel + 1, **kwargs)


def rank_zero_deprecation(message: Union[str, Warning], stacklevel: int = 5, **kwargs: Any) -> None:
    """A deprecation warning on global rank 0 only."""
    ensure_rank()
    _shared().rank_zero_deprecation(message, stacklevel=stacklevel + 1, **kwargs)


def _shared() -> Any:
    """lightning_utilities' rank_zero module (imported on first use)."""
    from lightning_utilities.core import rank_zero

    return rank_zero
