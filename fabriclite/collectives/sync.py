"""barrier and rank_zero_first."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from fabriclite.collectives.header import agree
from fabriclite.collectives.packing import begin
from fabriclite.collectives.plans import BARRIER, Call, tag
from fabriclite.collectives.state import Context, Strategy, state_of
from fabriclite.distributed.rendezvous import raise_if_failed

_POLL_FIRST_S, _POLL_MAX_S = 0.001, 0.1
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
def rank_zero_first(strategy: Strategy, local: bool = False) -> Iterator[None]:
    """See ``fabriclite.collectives.rank_zero_first``."""
    if strategy.world_size == 1:
        yield
        return
    state = state_of(strategy)
    state.rank_zero_first_calls += 1
    store = strategy.store
    if store is None:
        with _over_broadcast(strategy):
            yield
        return
    first = (strategy.local_rank if local else strategy.global_rank) == 0
    key = f"collectives/rank_zero_first/{state.rank_zero_first_calls}"
    if local:
        key += f"/node{strategy.node_rank}"
    if first:
        try:
            yield
        except BaseException as err:
            store.set(key, f"{type(err).__name__}: {err}")
            raise
        store.set(key, _OK)
        return
    status = _wait(store, key)
    if status != _OK:
        who = f"local rank 0 of node {strategy.node_rank}" if local else "rank 0"
        raise RankZeroFailed(f"rank_zero_first: {who} raised inside the block, so this rank (rank "
                             f"{strategy.global_rank}) did not run it: {status}")
    yield


def _wait(store: Any, key: str) -> str:
    """Poll ``key`` until it exists, without a deadline (rank 0 may be downloading for an hour), but not
    past a failure the job's supervisor reported."""
    delay = _POLL_FIRST_S
    while not store.check([key]):
        time.sleep(delay)
        delay = min(delay * 1.5, _POLL_MAX_S)
        if delay == _POLL_MAX_S:  # a failure elsewhere in the job ends the wait (JobFailedElsewhere)
            raise_if_failed(store, "waiting for rank 0 in rank_zero_first")
    raw = store.get(key)
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


@contextmanager
def _over_broadcast(strategy: Strategy) -> Iterator[None]:
    """Without a store: rank 0 runs the block, then broadcasts its outcome (the wait is then bounded by the
    collective timeout); ``local`` is treated as global."""
    from fabriclite.collectives import broadcast

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
