"""``Fabric``'s checkpoints and resumption: save / load (atomic, see fabriclite.checkpoint), ``keep=`` and
``load_latest`` (fabriclite.manifest), ``resume_state`` (fabriclite.resume) and preemption (fabriclite.preemption).

A part of the facade, mixed into ``Fabric`` (which provides ``_strategy``, ``_preempted``, ``_check_launched`` and
``call``); each method forwards.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Union

from torch import nn
from torch.optim import Optimizer

from fabriclite import checkpoint, manifest, preemption, resume, wrappers
from fabriclite.wrappers import FabricDataLoader, FabricModule, FabricOptimizer

if TYPE_CHECKING:
    from fabriclite.strategies import Strategy


class FabricCheckpoints:
    """Checkpoints, resumption and preemption, as ``fabric.<name>(...)``."""

    _strategy: "Strategy"
    _preempted: bool

    if TYPE_CHECKING:  # provided by FabricCollectives and Fabric
        def _check_launched(self, what: str) -> None: ...

        def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None: ...

    def save(self, path: Union[str, "os.PathLike[str]"], state: Dict[str, Any],
             filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None, *, keep: Optional[int] = None) -> None:
        """Write ``state`` to ``path`` on global rank 0, atomically; every rank returns when it is complete.
        ``keep=K``: record it in the directory's manifest and keep this run's K newest (see fabriclite.manifest)."""
        self._check_launched("save")
        unwrapped = wrappers.unwrap(state, loaders=False)
        if keep is None:
            checkpoint.save(self._strategy, path, unwrapped, filter)
        else:
            manifest.save(self._strategy, path, unwrapped, filter, keep)

    def load(self, path: Union[str, "os.PathLike[str]"], state: Optional[Dict[str, Any]] = None,
             strict: bool = True, *, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Restore ``state`` in place from ``path``; returns what was not restored (all of it without state)."""
        self._check_launched("load")
        unwrapped = wrappers.unwrap(state, loaders=False)
        resume.set_strict(unwrapped, strict)
        remainder = checkpoint.load(self._strategy, path, unwrapped, strict=strict, weights_only=weights_only)
        if state is not None:
            for key, value in unwrapped.items():
                if not isinstance(state[key], (FabricModule, FabricOptimizer, FabricDataLoader)):
                    state[key] = value
        return remainder

    def load_latest(self, directory: Union[str, "os.PathLike[str]"], state: Optional[Dict[str, Any]] = None,
                    strict: bool = True, *, weights_only: Optional[bool] = None) -> Optional[str]:
        """``load`` the newest checkpoint ``directory``'s manifest records: its path, or None (fabriclite.manifest)."""
        self._check_launched("load_latest")
        path = manifest.latest(self._strategy, directory)
        if path is not None:
            self.load(path, state, strict=strict, weights_only=weights_only)
        return path

    def check_preempted(self) -> bool:
        """Whether the job was told it will be stopped (SIGTERM / SIGUSR1 on any rank): a collective, one small
        all_reduce, the same answer on every rank at the same call. The first True also calls the callbacks'
        ``on_preempt(fabric)`` hook. Call it every N steps and save then (see fabriclite.preemption)."""
        self._check_launched("check_preempted")
        agreed = preemption.check(self._strategy)
        if agreed and not self._preempted:
            self._preempted = True
            self.call("on_preempt", self)
        return agreed

    @property
    def preempted(self) -> bool:
        """The last answer of ``check_preempted()`` (False before the first call)."""
        return self._preempted

    def resume_state(self) -> resume.ResumeState:
        """``state["resume"] = fabric.resume_state()``: every rank's RNG states saved (fabriclite.resume)."""
        return resume.ResumeState(self._strategy)

    def load_raw(self, path: Union[str, "os.PathLike[str]"], obj: Union[nn.Module, Optimizer], strict: bool = True,
                 *, weights_only: Optional[bool] = None) -> None:
        """Load a bare state_dict file (made without Fabric) into a module or optimizer."""
        self._check_launched("load_raw")
        checkpoint.load_raw(self._strategy, path, wrappers.unwrap(obj), strict=strict, weights_only=weights_only)
