"""barrier and rank_zero_first."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from fabriclite.collectives.header import agree
from fabriclite.collectives.packing import begin
from fabriclite.collectives.plans import BARRIER, Call, tag
from fabriclite.collectives.state import Context, Strategy, state_of
from fabriclite.distributed.control_plane import keys, rank_zero_first as first_rank

_OK = "ok"


def barrier(ctx: Context, name: Optional[str], check: bool) -> None:
    """See ``fabriclite.collectives.barrier``."""
    if ctx.size == 1:
        return
    if not check:
        ctx.strategy.barrier(name, ctx.group)
        return
    call = Call(BARRIER)
    agree(ctx, begin(ctx), tag(ctx, call), 0, call)


class RankZeroFailed(RuntimeError):
    """Raised on the waiting ranks of ``rank_zero_first`` when rank 0's block raised."""


@contextmanager
def rank_zero_first(strategy: Strategy, local: bool, broadcast: Callable[..., Any]) -> Iterator[None]:
    """See ``fabriclite.collectives.rank_zero_first`` (``broadcast``: its ``broadcast``, used without a store)."""
    if strategy.world_size == 1:
        yield
        return
    state = state_of(strategy)
    state.rank_zero_first_calls += 1
    store = strategy.store
    if store is None:
        with _over_broadcast(strategy, broadcast):
            yield
        return
    first = (strategy.local_rank if local else strategy.global_rank) == 0
    key = keys.rank_zero_first(state.rank_zero_first_calls, strategy.node_rank if local else None)
    readers = _readers(strategy, local)
    if first:
        try:
            yield
        except BaseException as err:
            first_rank.announce(store, key, f"{type(err).__name__}: {err}", readers)
            raise
        first_rank.announce(store, key, _OK, readers)
        return
    status = first_rank.wait(store, key, readers)
    if status != _OK:
        who = f"local rank 0 of node {strategy.node_rank}" if local else "rank 0"
        raise RankZeroFailed(f"rank_zero_first: {who} raised inside the block, so this rank (rank "
                             f"{strategy.global_rank}) did not run it: {status}")
    yield


def _readers(strategy: Strategy, local: bool) -> Optional[int]:
    """How many ranks wait for the first one's word (the last to read it deletes it); None where the layout is not
    known for sure (the word is then kept)."""
    if not local:
        return strategy.world_size - 1
    local_world_size = getattr(strategy, "local_world_size", None)
    per_node = local_world_size() if callable(local_world_size) else 0
    return per_node - 1 if per_node * getattr(strategy, "num_nodes", 0) == strategy.world_size else None


@contextmanager
def _over_broadcast(strategy: Strategy, broadcast: Callable[..., Any]) -> Iterator[None]:
    """Without a store: rank 0 runs the block, then broadcasts its outcome (the wait is then bounded by the
    collective timeout); ``local`` is treated as global."""
    if strategy.global_rank == 0:
        try:
            yield
        except BaseException as err:
            broadcast(strategy, f"{type(err).__name__}: {err}", 0)
            raise
        broadcast(strategy, _OK, 0)
        return
    status = broadcast(strategy, None, 0)
    if status != _OK:
        raise RankZeroFailed(f"rank_zero_first: rank 0 raised inside the block, so this rank (rank "
                             f"{strategy.global_rank}) did not run it: {status}")
    yield
