"""``Fabric``'s collectives (barrier, broadcast, all_gather, all_reduce, gather, reduce, rank_zero_first) and the
rule that none of them, nor any other call that reaches torch.distributed, runs before the job is joined.

A part of the facade, mixed into ``Fabric`` (which provides ``_strategy`` and ``_launched``): each method checks
that the job is joined, then forwards to ``fabriclite.collectives``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Generator, Optional

from fabriclite import collectives

if TYPE_CHECKING:
    from fabriclite.strategies import Strategy


class FabricCollectives:
    """Collectives over nested collections, as ``fabric.<name>(...)``."""

    _strategy: "Strategy"
    _launched: bool

    def _check_launched(self, what: str) -> None:
        """RuntimeError before the job is joined (several processes, no ``launch()`` yet), before anything
        reaches torch.distributed (Lightning's rule: every strategy but the single-device one)."""
        if not self._launched and not self._strategy.single_device:
            raise RuntimeError(f"fabric.{what}() with strategy={self._strategy.name!r} needs this process to join the "
                               "job: call fabric.launch() first (under torchrun / srun / mpirun too), or start the "
                               "script with `fabriclite run`.")


    def barrier(self, name: Optional[str] = None, check: bool = True) -> None:
        """Wait until every rank reaches this point (see fabriclite.collectives.barrier)."""
        self._check_launched("barrier")
        collectives.barrier(self._strategy, name, check=check)

    def broadcast(self, obj: Any, src: int = 0, check: bool = True) -> Any:
        """``obj`` from global rank ``src`` on every rank (see fabriclite.collectives.broadcast)."""
        self._check_launched("broadcast")
        return collectives.broadcast(self._strategy, obj, src, check=check)

    def all_gather(self, data: Any, group: Optional[Any] = None, sync_grads: bool = False, cat: bool = False,
                   check: bool = True) -> Any:
        """Every rank's ``data``, leaf by leaf (see fabriclite.collectives.all_gather)."""
        self._check_launched("all_gather")
        return collectives.all_gather(self._strategy, data, group=group, sync_grads=sync_grads, cat=cat, check=check)

    def all_reduce(self, data: Any, group: Optional[Any] = None, reduce_op: Any = "mean", check: bool = True,
                   inplace: bool = False) -> Any:
        """``data`` reduced over the ranks, leaf by leaf (see fabriclite.collectives.all_reduce)."""
        self._check_launched("all_reduce")
        return collectives.all_reduce(self._strategy, data, group=group, reduce_op=reduce_op, check=check,
                                      inplace=inplace)

    def gather(self, data: Any, dst: int = 0, group: Optional[Any] = None) -> Any:
        """A list of every rank's ``data`` on rank ``dst``; None elsewhere."""
        self._check_launched("gather")
        return collectives.gather(self._strategy, data, dst=dst, group=group)

    def reduce(self, data: Any, dst: int = 0, reduce_op: Any = "mean", group: Optional[Any] = None,
               check: bool = True, inplace: bool = False) -> Any:
        """``data`` reduced over the ranks on rank ``dst``; None elsewhere (see fabriclite.collectives.reduce)."""
        self._check_launched("reduce")
        return collectives.reduce(self._strategy, data, dst=dst, reduce_op=reduce_op, group=group, check=check,
                                  inplace=inplace)

    @contextmanager
    def rank_zero_first(self, local: bool = False) -> Generator[None, None, None]:
        """Rank 0 (of each node with ``local=True``) runs the block first; the others wait, without a
        deadline, and raise rank 0's error if its block raised."""
        self._check_launched("rank_zero_first")
        with collectives.rank_zero_first(self._strategy, local=local):
            yield
