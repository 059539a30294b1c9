"""Training across slow links on the live-recovery path: ``strategy="diloco"`` / ``"local_sgd"`` (or an instance,
:class:`DiLoCoStrategy` / :class:`LocalSGDStrategy`, with its settings) in a script started by ``fabriclite run
--fault-tolerant`` (``--strategy diloco`` and the flags of :data:`FLAGS` do the same from the command line).

Each node is one torchft replica group of one rank, as under ``strategy="fault_tolerant"``, but the groups do not
all-reduce gradients every step: each trains alone with the script's own optimizer (the inner one; DiLoCo's paper
uses AdamW) and the groups meet only every ``sync_every`` inner steps, through torchft 0.2.0's own ``LocalSGD``
(the parameters averaged) or ``DiLoCo`` (the pseudo-gradient, global minus local weights, averaged and applied
by an outer optimizer: SGD, lr 0.7, momentum 0.9, Nesterov, the paper's). ``fragments > 1`` is streaming DiLoCo:
the model's parameters are cut into that many contiguous fragments of about equal size, synced in turn, one every
``sync_every / fragments`` steps, each ``fragment_sync_delay`` steps after its all-reduce started, mixed with the
local weights by ``fragment_update_alpha``. The torchft parts are built in
``fabriclite.strategies.torchft.diloco_sync``; every setting is checked in
``fabriclite.strategies.torchft.diloco_settings``, at ``Fabric(...)`` (the instance's constructor) or when
``fabriclite run`` parses its flags, before a Manager exists.

What differs from ``strategy="fault_tolerant"``:

- ``fabric.setup(model, optimizer)`` wraps nothing in torchft's DDP or optimizer wrappers: ``optimizer.step()`` is
  the inner step, and every ``sync_every``-th (each fragment's turn) also syncs with the other groups.
- ``fabric.load_latest(dir, state)`` (after ``setup``, before the first step, as before) takes part in a quorum:
  at the job's start it brings every group to group 0's initial state and commits step 1 with no all-reduce
  (torchft 0.2.0's DiLoCo regression test also starts with one quorum and no all-reduce, but commits twice: its
  loop starts at step 2); a group that comes back mid-run waits for the live groups' next sync, receives their
  state (model, inner optimizer, step, and per fragment the global weights and the outer optimizer: torchft's
  ``StreamingDiLoCoFragment_{i}``) and takes part in that same sync with its first ``optimizer.step()``
  (:meth:`LowCommunicationStrategy.heal`).
- ``fabric.save`` adds the key ``"low_communication"`` to the checkpoint (the global weights, the outer
  optimizers, the Manager's step, which says the next fragment, and the inner step inside the interval);
  ``fabric.load`` / ``load_latest`` of a dict state restore it.
- At the end of a DiLoCo run (the strategy's teardown, when nothing raised) the groups still running compare
  their committed syncs and a checksum of their global weights in one more quorum; a mismatch is a RuntimeError
  naming each group's values (a sync whose all-reduce failed in one group commits in the others: torchft's
  vote is per group; the next sync's quorum would heal the group behind, but after the last one nothing does).
- Floating-point buffers (BatchNorm statistics) are averaged at every sync, inside its commit; integer buffers
  (``num_batches_tracked``) stay local.
- ``should_quantize=True`` needs Triton (torchft: ``if should_quantize and IS_TRITON_AVAILABLE``; otherwise it
  silently sends full precision): without Triton it is a ValueError here, never a setting that does nothing.
"""
from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Dict, Optional

from torch import nn
from torch.optim import Optimizer

from fabriclite.strategies.torchft.diloco_settings import (FLAGS, SETTINGS_ENV, OuterOptimizer, Settings,
                                                           fragments_of, resolve)
from fabriclite.strategies.torchft.replica_strategy import HEAL_ATTEMPTS, FaultTolerantStrategy

#: the checkpoint key the strategy adds (see the module docstring)
CHECKPOINT_KEY = "low_communication"


def _failing() -> bool:
    """Whether the process is ending on an error (an exception being handled, or an uncaught one already
    reported): the end-of-run comparison then does not run (the other groups may be mid-sync)."""
    return sys.exc_info()[0] is not None or getattr(sys, "last_value", None) is not None


class LowCommunicationStrategy(FaultTolerantStrategy):
    """The shared part of :class:`DiLoCoStrategy` and :class:`LocalSGDStrategy` (see the module docstring)."""

    scheme = ""
    #: one rank per replica group (groups of several ranks: the per-step path only, for now)
    groups_of_several_ranks = False

    def __init__(self, settings: Dict[str, Any], **kwargs: Any) -> None:
        self.settings = resolve(self.scheme, settings)
        super().__init__(**kwargs)
        self._module: Optional[nn.Module] = None
        self._sync: Any = None
        #: healed mid-run by load_latest: the next optimizer.step() is the live groups' sync (heal)
        self._join_pending = False

    def new_manager(self) -> Any:
        """A Manager with a synchronous quorum (torchft's DiLoCo requires it; a group that comes back is healed
        inside the quorum, before the sync it then takes part in) whose commit also checks the sync's
        all-reduces (fabriclite.strategies.torchft.diloco_sync.SyncManager)."""
        from fabriclite.strategies.torchft import diloco_sync

        return self._build_manager(manager_class=diloco_sync.SyncManager, use_async_quorum=False)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """The module as it is: no per-step gradient all-reduce (torchft's DDP is never used here)."""
        if self._module is not None:
            raise ValueError(f"strategy={self.name!r} trains one module (with one optimizer); set up one model.")
        self._module = module
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The inner optimizer, as it is; torchft's LocalSGD / DiLoCo hooks its step (built here, so before
        ``load_latest`` takes its first quorum)."""
        if self._module is None:
            raise ValueError(f"strategy={self.name!r}: set up the model first (fabric.setup(model, optimizer)).")
        if self._sync is not None:
            raise ValueError(f"strategy={self.name!r} takes one (inner) optimizer; got a second one.")
        fragments = fragments_of(self._module, self.settings.fragments) if self.scheme == "diloco" else None
        from fabriclite.strategies.torchft import diloco_sync  # imports torchft

        self._sync = diloco_sync.build(self.manager, self._module, optimizer, self.settings, fragments)
        return optimizer

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """Nothing synchronises in backward here: a no-op."""
        return nullcontext()

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """The inner step (torchft's hooks sync when it is time). The first step after ``load_latest`` healed this
        group from a live peer is that peer's sync instead (see :meth:`heal`)."""
        if not self._state_registered:
            raise RuntimeError(f"under strategy={self.name!r}, call fabric.load_latest(checkpoint_dir, state) before "
                               "the first optimizer.step(): that state is what a group that comes back receives.")
        if self._join_pending:
            self._join_pending = False
            self._sync.join()
            return None
        return super().optimizer_step(optimizer, **kwargs)

    def heal(self, state_fn: Callable[[], Dict[str, Any]], apply_fn: Callable[[Dict[str, Any]], None]) -> int:
        """As the fault_tolerant strategy's (register ``state``, take part in a quorum; the step the live groups
        have committed, 0 when none has), with a synchronous quorum. At the job's start (step 0) every group of the
        quorum is here, and it commits step 1 with no all-reduce. Later, the live groups of the quorum are inside
        an ``optimizer.step()``, at a sync, and this group was healed inside the quorum to their state as it was
        there: the model after that inner step, the script's counters before the end of that iteration. So this
        group's next ``optimizer.step()`` (the same iteration, by the counters) takes part in that sync in place of
        its inner step (whose gradients are dropped), and both go on from the same iteration."""
        if self._sync is None:
            raise RuntimeError(f"under strategy={self.name!r}, call fabric.setup(model, optimizer) before "
                               "fabric.load_latest(): the sync must exist before the first quorum.")
        manager = self._register_state(state_fn, apply_fn)
        deadline = self.first_quorum_deadline()
        failures = 0
        while failures < HEAL_ATTEMPTS:
            manager.start_quorum()
            if manager.errored() is not None:
                failures += 1
                continue
            if self.first_quorum_incomplete(manager, deadline):
                continue
            step = manager.current_step()
            if step == 0:
                manager.should_commit()
                return 0
            self._join_pending = True
            return step
        raise self._heal_failed()

    def sync_state(self) -> Dict[str, Any]:
        """The sync's state as checkpoints hold it: ``scheme``, ``manager`` (torchft's step: syncs committed, which
        says the next fragment), ``local_step`` (inner steps since the last sync) and, for DiLoCo, per fragment
        ``original_parameters`` (the global weights) and ``outer_optimizer``. Tensors are this rank's own (the
        global weights are copies; the outer optimizer's state is live)."""
        if self._sync is None:
            raise RuntimeError(f"strategy={self.name!r}: no sync before fabric.setup(model, optimizer).")
        return self._sync.state_dict()

    def checkpoint_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """The checkpoint with the sync's own state under ``"low_communication"``."""
        if self._sync is None:
            return state
        if CHECKPOINT_KEY in state:
            raise ValueError(f"strategy={self.name!r} stores its state under the checkpoint key {CHECKPOINT_KEY!r}; "
                             "rename that key of your state.")
        return {**state, CHECKPOINT_KEY: self.sync_state()}

    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """As every strategy's; a dict ``state`` also restores the sync's state the checkpoint holds."""
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if isinstance(state, dict) and state and CHECKPOINT_KEY in remainder and self._sync is not None:
            self._sync.load_state_dict(remainder.pop(CHECKPOINT_KEY))
        return remainder

    def teardown(self) -> None:
        """Close the sync; at the end of a DiLoCo run that raised nothing, first compare the groups' global weights
        (:meth:`check_end`)."""
        try:
            if self._sync is not None and self._state_registered and not _failing():
                self.check_end()
        finally:
            if self._sync is not None:
                self._sync.close()
                self._sync = None
            super().teardown()

    def check_end(self) -> None:
        """DiLoCo: every live group of the job compares its committed syncs and a checksum of its global weights
        with the others'; RuntimeError naming the groups when they differ (fabriclite.strategies.torchft.
        diloco_sync.DiLoCoSync.check_end). LocalSGD: nothing (its weights part after each sync)."""
        if self.scheme == "diloco" and self._sync is not None and self.options is not None:
            self._sync.check_end(self.options.group, self.options.groups)


class DiLoCoStrategy(LowCommunicationStrategy):
    """DiLoCo / streaming DiLoCo on torchft (module docstring). Defaults: the paper's (``sync_every=500``; outer
    SGD, lr 0.7, momentum 0.9, Nesterov); ``fabriclite run`` flags fill what is not given here."""

    name = "diloco"
    scheme = "diloco"

    def __init__(self, sync_every: Optional[int] = None, fragments: Optional[int] = None,
                 fragment_sync_delay: Optional[int] = None, fragment_update_alpha: Optional[float] = None,
                 outer_optimizer: Optional[OuterOptimizer] = None, outer_lr: Optional[float] = None,
                 outer_momentum: Optional[float] = None, should_quantize: Optional[bool] = None,
                 **kwargs: Any) -> None:
        super().__init__(dict(sync_every=sync_every, fragments=fragments, fragment_sync_delay=fragment_sync_delay,
                              fragment_update_alpha=fragment_update_alpha, outer_optimizer=outer_optimizer,
                              outer_lr=outer_lr, outer_momentum=outer_momentum, should_quantize=should_quantize),
                         **kwargs)


class LocalSGDStrategy(LowCommunicationStrategy):
    """LocalSGD on torchft: the groups' parameters averaged every ``sync_every`` steps (default 100)."""

    name = "local_sgd"
    scheme = "local_sgd"

    def __init__(self, sync_every: Optional[int] = None, **kwargs: Any) -> None:
        super().__init__(dict(sync_every=sync_every), **kwargs)


__all__ = ["DiLoCoStrategy", "FLAGS", "fragments_of", "LocalSGDStrategy", "SETTINGS_ENV", "Settings", "resolve"]
