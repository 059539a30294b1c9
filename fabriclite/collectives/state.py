"""Per-strategy state of the collectives (structure caches, header buffers and tags, call counters) and the
context of one call (the group, its size, this rank's place in it, the device buffers live on)."""
from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Optional, Protocol, Tuple

import torch
from torch import Tensor

from fabriclite.collectives.structure import SpecCache

_ATTR = "_fabriclite_collectives"


class Strategy(Protocol):
    """What the collectives need of a strategy: where this rank is, its groups, and the flat primitives
    (``fabriclite.strategies.base.Strategy`` documents their contract). The collectives import no strategy.
    Optional, looked up with ``getattr``: ``flat_all_gather_into_async(out, tensor, group)`` starts
    ``flat_all_gather_into`` and returns the function that waits for it and returns ``out`` (DDPStrategy has it):
    the header exchange then runs while an all_gather finds its result buffer."""

    root_device: torch.device
    world_size: int
    global_rank: int
    local_rank: int
    node_rank: int
    distributed_ready: bool
    #: no process groups (one process, identities as primitives): Lightning's single-device contract applies
    single_device: bool
    supported_reduce_ops: FrozenSet[str]
    store: Optional[Any]

    def resolve_group(self, group: Any) -> Any: ...
    def group_size(self, group: Any = None) -> int: ...
    def group_rank(self, group: Any = None) -> int: ...
    def group_ranks(self, group: Any = None) -> List[int]: ...
    def flat_all_reduce(self, tensor: Tensor, op: str = "sum", group: Any = None) -> Tensor: ...
    def flat_all_reduce_copy(self, out: Tensor, tensor: Tensor, op: str = "sum", group: Any = None,
                             divisor: Optional[int] = None) -> Tensor: ...
    def flat_all_gather(self, tensor: Tensor, group: Any = None) -> Tensor: ...
    def flat_all_gather_into(self, out: Tensor, tensor: Tensor, group: Any = None) -> Tensor: ...
    def flat_broadcast(self, tensor: Tensor, src: int = 0, group: Any = None) -> Tensor: ...
    def all_gather_object(self, obj: Any, group: Any = None) -> List[Any]: ...
    def broadcast_object(self, obj: Any, src: int = 0, group: Any = None) -> Any: ...
    def barrier(self, name: Optional[str] = None, group: Any = None) -> None: ...


class State:
    """Owned by one strategy object (stored on it): nothing is shared between strategies."""

    def __init__(self) -> None:
        self.specs = SpecCache()
        self.rank_zero_first_calls = 0
        #: (group size, this rank's index, device) -> the header buffer
        self.headers: Dict[Tuple[int, int, torch.device], Any] = {}
        #: header Call -> its 32-bit tag
        self.tags: Dict[Any, int] = {}
        self.ranks: Dict[Any, List[int]] = {}
        #: id(group handle) -> (handle, group size, this rank's index): a group's membership never changes
        self.places: Dict[int, Tuple[Any, int, int]] = {}
        #: the world group's Context, reused by every call once the process group is up
        self.world: Optional["Context"] = None


def state_of(strategy: Strategy) -> State:
    state = strategy.__dict__.get(_ATTR)
    if state is None:
        state = State()
        setattr(strategy, _ATTR, state)
    return state


class Context:
    """One collective call: ``group`` (the resolved handle), ``size``, ``index`` (this rank's position in
    the group), ``device`` (where buffers live: the strategy's root device)."""

    __slots__ = ("strategy", "group", "size", "index", "device", "state", "single_device", "header")

    def __init__(self, strategy: Strategy, group: Any = None) -> None:
        self.strategy = strategy
        self.state = state = state_of(strategy)
        self.group = strategy.resolve_group(group)
        where = state.places.get(id(self.group))
        if where is None or where[0] is not self.group:
            size = strategy.group_size(self.group)
            where = (self.group, size, strategy.group_rank(self.group) if size > 1 else 0)
            if strategy.distributed_ready:
                state.places[id(self.group)] = where
        self.size, self.index = where[1], where[2]
        self.device = strategy.root_device
        #: Lightning's single-device contract (all_gather adds no dim)
        self.single_device = strategy.single_device
        #: the group's header on this rank (packing.begin makes it)
        self.header: Any = None

    @property
    def ranks(self) -> List[int]:
        """Global ranks of the group's members, in group order."""
        key = (id(self.group), self.size)
        ranks = self.state.ranks.get(key)
        if ranks is None:
            ranks = self.state.ranks[key] = list(self.strategy.group_ranks(self.group))
        return ranks

    def member_index(self, rank: int, what: str) -> int:
        """The group position of global ``rank``; ValueError naming ``what`` (``src=5``) when it is not a member."""
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ValueError(f"{what}: expected an int global rank, got {type(rank).__name__}.")
        ranks = self.ranks
        try:
            return ranks.index(rank)
        except ValueError:
            where = f"0..{self.size - 1}" if ranks == list(range(self.size)) else f"the group's ranks {ranks}"
            raise ValueError(f"{what} is out of range: expected a global rank in {where}.") from None


def context(strategy: Strategy, group: Any = None) -> Context:
    """The Context of a call on ``group``: for the world group, one Context per strategy, made once the
    process group is up (a group's size, this rank's place and the root device do not change then)."""
    state = strategy.__dict__.get(_ATTR)
    if group is None and state is not None and state.world is not None:
        return state.world
    ctx = Context(strategy, group)
    if group is None and strategy.distributed_ready:
        ctx.state.world = ctx
    return ctx
