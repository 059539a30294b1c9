"""``fabric.load_latest(dir, state)``: the newest checkpoint on disk, or, under ``fabriclite run --fault-tolerant``,
a live peer's state first.

Under --fault-tolerant, ``state`` (model, optimizer, scheduler, step counter, loader position, RNG states: the
dict the script keeps up to date every step) is registered with this replica group's torchft Manager, and the
call takes part in a quorum. If a live group has committed steps, this group receives that group's ``state`` over
the network, from memory, applied in place before the call returns (its next ``zero_grad`` joins that same
quorum's step); the disk is not read. Only when no group has committed a step (the job is starting, or every
group died) is the newest checkpoint on disk loaded, as without the flag.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Union

from fabriclite.checkpoint import latest
from fabriclite.checkpoint.resume_state import set_strict
from fabriclite.checkpoint.saving import restore_into, to_saveable
from fabriclite.strategies.torchft.replica_strategy import FaultTolerantStrategy
from fabriclite.training.wrapping import FabricDataLoader, FabricModule, FabricOptimizer, unwrap

#: what ``load_latest`` returns when a live peer's state was applied (it names no file)
PEER = "<live peer>"


def load_latest(strategy: Any, directory: Union[str, "os.PathLike[str]"], state: Optional[Dict[str, Any]],
                strict: bool, load: Callable[[str], Any]) -> Optional[str]:
    """See the module docstring. ``load(path)`` is ``fabric.load(path, state, ...)``. Returns the path loaded,
    :data:`PEER` when a live peer's state was applied, or None (nothing to resume from)."""
    if isinstance(strategy, FaultTolerantStrategy):
        if state is None:
            raise TypeError("under --fault-tolerant, fabric.load_latest(dir, state) needs the state dict (model, "
                            "optimizer, step, ...): it is what a group that comes back receives from a live peer.")
        step = strategy.heal(lambda: to_saveable(strategy, unwrap(state, loaders=False)),
                             lambda received: restore_state(strategy, state, received, strict))
        if step > 0:
            return PEER
    return latest.load_latest(strategy, directory, load)


def restore_state(strategy: Any, state: Dict[str, Any], checkpoint: Dict[str, Any], strict: bool) -> None:
    """Restore the script's ``state`` (wrappers and all) in place from ``checkpoint``, as ``fabric.load`` does:
    objects load their state dicts, plain values (the step counter) are replaced in ``state``."""
    unwrapped = unwrap(state, loaders=False)
    set_strict(unwrapped, strict)
    restore_into(strategy, unwrapped, dict(checkpoint), strict, "the live peer's state")
    keep_values(state, unwrapped)


def keep_values(state: Dict[str, Any], restored: Dict[str, Any]) -> None:
    """Copy the plain values ``restored`` (unwrapped from ``state``) received back into ``state``; wrapped objects
    were restored in place."""
    for key, value in restored.items():
        if not isinstance(state[key], (FabricModule, FabricOptimizer, FabricDataLoader)):
            state[key] = value
