"""What the sharded strategies (fsdp, model_parallel) share on top of DDP's processes and collectives: meta-device
init, the optimizer following the sharded parameters, gradient clipping over every shard, FSDP2's gradient-sync
switch, and checkpoints (``fabriclite.checkpoint.dcp``; written in the background with ``async_save=True``, see
``fabriclite.checkpoint.async_save``; like Lightning's, they take no CheckpointIO plugin). Subclasses say how a
module is sharded (``setup_module``) and over which mesh (``setup_environment`` sets ``_device_mesh``)."""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from fabriclite.checkpoint.async_save import AsyncCheckpointIO, AsyncShardedSaves
from fabriclite.checkpoint.checkpoint_io import CheckpointIO, TorchCheckpointIO
from fabriclite.strategies import fsdp2 as sharding
from fabriclite.strategies.ddp import DDPStrategy


class ShardedStrategy(DDPStrategy):
    """Base of FSDPStrategy and ModelParallelStrategy (not used by name)."""

    #: checkpoints as a torch.distributed.checkpoint directory (else one full file); set by subclasses
    sharded_checkpoints: bool = True

    def _init_sharded(self, async_save: bool = False) -> None:
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save={async_save!r}: expected True (checkpoints written in the background) or "
                            "False.")
        self._device_mesh: Any = None
        self._modules: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        #: asynchronous sharded saves (torch.distributed.checkpoint's async_save), or None: synchronous
        self.async_saves: Optional[AsyncShardedSaves] = AsyncShardedSaves() if async_save else None
        self._file_io: CheckpointIO = AsyncCheckpointIO() if async_save else TorchCheckpointIO()

    @property
    def device_mesh(self) -> Any:
        """The DeviceMesh parameters are placed on (after ``setup_environment``)."""
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists once the processes have started: call fabric.launch() first.")
        return self._device_mesh

    # ------------------------------------------------------------------ set-up
    def module_to_device(self, module: nn.Module) -> nn.Module:
        """Moved to the device unless it is on the meta device (``setup`` materialises it after sharding)."""
        if sharding.has_meta(module) or getattr(self, "cpu_offload", False):
            return module
        return module.to(self.root_device)

    def module_init_context(self, empty_init: Optional[bool] = None) -> Any:
        """With ``empty_init=True`` modules are built on the meta device (no memory); ``setup`` shards them and
        runs each submodule's ``reset_parameters()``, so no rank ever holds the full model."""
        if not empty_init:
            return super().module_init_context(empty_init)
        from fabriclite.strategies.module_init import module_init_context

        return module_init_context(torch.device("meta"), self.precision.module_init_context(), False)

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: List[Optimizer],
                                    scheduler: Optional[Any] = None
                                    ) -> Tuple[nn.Module, List[Optimizer], Optional[Any]]:
        """Shard ``module``; optimizers built from it before are re-pointed at the sharded parameters (same order).
        ValueError for an optimizer that holds state already. The scheduler passes through unchanged."""
        sharding.check_repointable(optimizers)
        names = sharding.parameter_names(module)
        module = self.setup_module(module)
        sharding.repoint(optimizers, names, module)
        return module, optimizers, scheduler

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return optimizer

    # ------------------------------------------------------------------ training
    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> Any:
        """FSDP2's gradient-sync switch: backward calls inside keep unsharded gradients locally; the first
        backward outside reduces them all (a module without FSDP2 parts has nothing to switch)."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"no_backward_sync needs the module returned by setup(); got {type(module).__name__}.")
        return _no_sync(module, enabled)

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """The total norm over every shard (the value DDP would give), gradients scaled to ``max_norm``."""
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm, norm_type=norm_type,
                                              error_if_nonfinite=error_if_nonfinite)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_io(self) -> CheckpointIO:
        """Sharded strategies take no CheckpointIO plugin (Lightning's NotImplementedError)."""
        raise NotImplementedError(f"The `{type(self).__name__}` does not use the `CheckpointIO` plugin interface.")

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        hint = (f" For saves in the background pass {type(self).__name__}(async_save=True)."
                if isinstance(io, AsyncCheckpointIO) else "")
        raise NotImplementedError(f"The `{type(self).__name__}` does not support setting a `CheckpointIO` plugin.{hint}")

    @property
    def file_checkpoint_io(self) -> CheckpointIO:
        """The CheckpointIO of this strategy's one-file (full state) checkpoints: fabriclite's own."""
        return self._file_io

    @property
    def saves_in_background(self) -> bool:
        return self.async_saves is not None

    def wait_for_checkpoints(self) -> None:
        """Block until this rank's part of the asynchronous save in flight is written; raise its error."""
        try:
            if self.async_saves is not None:
                self.async_saves.wait()
        finally:
            if isinstance(self._file_io, AsyncCheckpointIO):
                self._file_io.wait()

    def module_of(self, optimizer: Optimizer) -> nn.Module:
        """The sharded module whose parameters ``optimizer`` holds; ValueError if none set up here does."""
        own = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for module in list(self._modules):
            if any(id(p) in own for p in module.parameters()):
                return module
        raise ValueError(f"{type(optimizer).__name__} holds no parameters of a module set up with strategy="
                         f"{self.name!r}; set the model up with fabric.setup() and build the optimizer from it.")

    def get_module_state_dict(self, module: nn.Module) -> Dict[str, Any]:
        """The full state_dict (gathered; on rank 0 only, ``{}`` elsewhere)."""
        from fabriclite.checkpoint import dcp

        return dcp.full_module_state(module)

    def load_module_state_dict(self, module: nn.Module, state_dict: Dict[str, Any], strict: bool = True) -> None:
        from fabriclite.checkpoint import dcp

        dcp.load_full_module_state(module, state_dict, strict)

    def get_optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """The full optimizer state keyed by parameter name (Lightning's FSDP full format), on rank 0."""
        from fabriclite.checkpoint import dcp

        return dcp.full_optimizer_state(self.module_of(optimizer), optimizer)

    def checkpoint_writer(self, state: Dict[str, Any], filter: Optional[Dict[str, Any]]) -> Any:
        """A sharded writer (``state_dict_type="sharded"``) or None: one file through the default path."""
        if not self.sharded_checkpoints:
            return None
        from fabriclite.checkpoint import dcp

        return dcp.ShardedWriter.from_state(self, state, filter)

    def teardown(self) -> None:
        self._device_mesh = None
        super().teardown()


@contextmanager
def _no_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    from torch.distributed.fsdp import FSDPModule

    fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m.set_requires_gradient_sync(not enabled, recurse=False)
    try:
        yield
    finally:
        for m in fsdp_modules:
            m.set_requires_gradient_sync(True, recurse=False)
