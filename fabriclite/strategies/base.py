"""The Strategy seam: how processes cooperate.

A strategy owns set-up (process group, module / optimizer wrapping, device moves) and exposes a few
collective *primitives* on flat tensors and Python objects. Everything a user calls on collections
(``fabriclite.collectives``) is written once on top of these primitives.

Primitive contract (every strategy). The primitives carry a ``flat_`` prefix where Lightning's strategy has
a method of the same name with another signature (``all_reduce``, ``all_gather``, ``broadcast``: user code
and LightningModule call those, see "Lightning's collective methods" below):

- ``flat_all_reduce(tensor, op, group)``: every rank gets the reduction; ``op`` is one of
  ``supported_reduce_ops`` ("sum", "min", "max", "prod", "band", "bor", "bxor"). May work in place on
  ``tensor`` (callers pass a buffer they own) and returns the result.
  ``flat_all_reduce_copy(out, tensor, op, group, divisor)``: the same into another buffer, ``tensor`` unchanged.
- ``flat_all_gather(tensor, group)``: equal shapes on every rank; returns ``(group_size, *shape)``.
  ``flat_all_gather_into(out, tensor, group)``: the same into a given contiguous ``out`` (default: a copy).
- ``flat_broadcast(tensor, src, group)``: ``src`` is a global rank; returns the tensor of ``src``
  (same shape and dtype on every rank).
- ``all_gather_object(obj, group)`` -> list in group-rank order; ``broadcast_object(obj, src, group)``.
- ``barrier(name, group)``.

Training hooks (defaults here suit any strategy whose ranks hold full replicas; override what differs):
``setup_module`` / ``setup_optimizer`` / ``setup_module_and_optimizers``, ``module_to_device``,
``batch_to_device``, ``backward``, ``optimizer_step``, ``no_backward_sync``, ``clip_gradients_norm`` /
``clip_gradients_value``, ``module_init_context`` / ``tensor_init_context``, ``distributed_sampler_kwargs``,
``process_dataloader``, and checkpoints: Lightning's ``checkpoint_io`` / ``save_checkpoint`` / ``load_checkpoint``
(``fabriclite.checkpoint.saving`` does the work, through the CheckpointIO for one file) and the hooks it asks
``get_module_state_dict`` / ``load_module_state_dict`` / ``get_optimizer_state`` / ``checkpoint_state`` /
``checkpoint_writer`` (a sharded strategy's directory).
"""
from __future__ import annotations

import os
import warnings
from abc import ABC, abstractmethod
from contextlib import nullcontext
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Dict, FrozenSet, Iterator, List,
                    Optional, Tuple, Union)

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from fabriclite import collectives
from fabriclite.accelerators.base import Accelerator
from fabriclite.checkpoint.async_save import AsyncCheckpointIO
from fabriclite.checkpoint.checkpoint_io import CheckpointIO, TorchCheckpointIO
from fabriclite.checkpoint.saving import load_checkpoint, save_checkpoint
from fabriclite.precision import Precision

if TYPE_CHECKING:
    from fabriclite.environments.base import ClusterEnvironment
    from fabriclite.launchers.base import Launcher

PathLike = Union[str, "os.PathLike[str]"]
ALL_REDUCE_OPS: FrozenSet[str] = frozenset({"sum", "min", "max", "prod", "band", "bor", "bxor"})


class Strategy(ABC):
    """Base strategy. The connector fills ``accelerator``, ``precision`` and ``cluster_environment``."""

    name: str = "base"
    supported_reduce_ops: FrozenSet[str] = ALL_REDUCE_OPS
    #: no process groups: one process whose primitives are identities (Lightning's single-device contract)
    single_device: bool = False

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision: Optional[Precision] = None,
        cluster_environment: Optional["ClusterEnvironment"] = None,
    ) -> None:
        self._checkpoint_io: Optional[CheckpointIO] = None
        if checkpoint_io is not None:
            self.checkpoint_io = checkpoint_io
        self.accelerator = accelerator
        self.precision = precision or Precision()
        self.cluster_environment = cluster_environment
        self._launcher: Optional["Launcher"] = None

    # ------------------------------------------------------------------ where this rank is
    @property
    @abstractmethod
    def root_device(self) -> torch.device:
        """The device this rank computes on."""

    @property
    def world_size(self) -> int:
        return 1

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def launcher(self) -> Optional["Launcher"]:
        """What starts the processes; None when they exist already (or there is one)."""
        return self._launcher

    @property
    def distributed_ready(self) -> bool:
        """Whether collectives can run now (always, for a single process)."""
        return True

    # ------------------------------------------------------------------ set-up
    def setup_environment(self) -> None:
        """Per rank, after launch: claim the device (and, for parallel strategies, join the group). Sets
        ``rank_zero_only.rank`` (lightning_utilities', which ``fabriclite.utilities`` exports) to this rank."""
        from lightning_utilities.core.rank_zero import rank_zero_only

        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        assert self.accelerator is not None, "the connector sets the accelerator"
        self.accelerator.setup_device(self.root_device, self.local_world_size())

    def local_world_size(self) -> int:
        return 1

    def module_to_device(self, module: nn.Module) -> nn.Module:
        return module.to(self.root_device)

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Wrap ``module`` for this strategy (DDP, ...); it is already on the device."""
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return optimizer

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None) -> Any:
        """Every tensor in the (nested) ``batch`` moved to ``device`` (default: the root device)."""
        from lightning_utilities.core.apply_func import apply_to_collection

        device = device or self.root_device
        return apply_to_collection(batch, Tensor, lambda t: t.to(device, non_blocking=True))

    def setup_module_and_optimizers(self, module: nn.Module, optimizers: List[Optimizer],
                                    scheduler: Optional[Any] = None
                                    ) -> Tuple[nn.Module, List[Optimizer], Optional[Any]]:
        """Wrap ``module`` (already on the device) and its optimizers together; strategies that must see
        both at once (XLA, sharded ones) override this. Default: ``setup_module`` + ``setup_optimizer``.
        Returns ``(module, optimizers, scheduler)``: the scheduler passes through unchanged (as Lightning's
        non-DeepSpeed strategies)."""
        return self.setup_module(module), [self.setup_optimizer(opt) for opt in optimizers], scheduler

    def module_init_context(self, empty_init: Optional[bool] = None) -> ContextManager:
        """Modules built inside get their parameters on this rank's device, in the precision's dtype, and
        with ``empty_init=True`` without running the parameter initialisers (for loading a checkpoint)."""
        from fabriclite.strategies.module_init import module_init_context

        return module_init_context(self.root_device, self.precision.module_init_context(), bool(empty_init))

    def tensor_init_context(self) -> ContextManager:
        """Tensors created inside land on this rank's device, in the precision's dtype."""
        from fabriclite.strategies.module_init import module_init_context

        return module_init_context(self.root_device, self.precision.tensor_init_context(), False)

    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """The precision's ``pre_backward`` / ``backward`` / ``post_backward``, in Lightning's order."""
        tensor = self.precision.pre_backward(tensor, module)
        self.precision.backward(tensor, module, *args, **kwargs)
        self.precision.post_backward(tensor, module)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        return self.precision.optimizer_step(optimizer, **kwargs)

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """Skip gradient synchronisation for backward calls inside the block (``module`` is the strategy's
        wrapper from ``setup_module``). Silently a no-op for one process; strategies that synchronise but
        cannot skip it warn and run the block with synchronisation."""
        if enabled and self.world_size > 1:
            warnings.warn(f"{type(self).__name__} cannot skip gradient synchronisation; no_backward_sync() has no "
                          "effect (gradients are still synchronised every backward).", stacklevel=3)
        return nullcontext()

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """Scale ``optimizer``'s gradients (unscaled first under AMP) so that their total ``norm_type``-norm
        is at most ``max_norm``; returns the norm before clipping. RuntimeError for a non-finite norm when
        ``error_if_nonfinite``."""
        self.precision.unscale_gradients(optimizer)
        return torch.nn.utils.clip_grad_norm_(_params(optimizer), max_norm=max_norm, norm_type=norm_type,
                                              error_if_nonfinite=error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float) -> None:
        """Clamp every gradient of ``optimizer`` (unscaled first under AMP) to ``[-clip_val, clip_val]``."""
        self.precision.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_value_(_params(optimizer), clip_value=clip_val)

    # ------------------------------------------------------------------ data
    @property
    def distributed_sampler_kwargs(self) -> Optional[Dict[str, int]]:
        """``num_replicas`` / ``rank`` for the DistributedSampler that ``setup_dataloaders`` puts in place;
        None: the strategy does not shard data (one process)."""
        return None

    def process_dataloader(self, dataloader: Any) -> Any:
        """Last say over a loader in ``setup_dataloaders`` (XLA wraps it in a device loader); default: as is."""
        return dataloader

    # ------------------------------------------------------------------ checkpoints
    @property
    def checkpoint_io(self) -> CheckpointIO:
        """The plugin that writes and reads one-file checkpoints (default ``TorchCheckpointIO``; Lightning's)."""
        if self._checkpoint_io is None:
            self._checkpoint_io = TorchCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        if not isinstance(io, CheckpointIO):
            raise TypeError(f"checkpoint_io={io!r} ({type(io).__name__}) is not a CheckpointIO; subclass "
                            "fabriclite.plugins.io.CheckpointIO (save_checkpoint, load_checkpoint, remove_checkpoint).")
        self._checkpoint_io = io

    @property
    def file_checkpoint_io(self) -> CheckpointIO:
        """What ``fabriclite.checkpoint.saving`` writes one-file checkpoints with: ``checkpoint_io`` (sharded
        strategies, which take no plugin, use their own for their full-state files)."""
        return self.checkpoint_io

    @property
    def saves_in_background(self) -> bool:
        """Whether checkpoints are written asynchronously (the same answer on every rank)."""
        return isinstance(self._checkpoint_io, AsyncCheckpointIO)

    def wait_for_checkpoints(self) -> None:
        """Block until this rank's asynchronous checkpoint writes are complete; raise the error of one that failed
        (``AsyncSaveError``, naming the path). Nothing to do for synchronous saves."""
        io = self._checkpoint_io
        if isinstance(io, AsyncCheckpointIO):
            io.wait()

    def save_checkpoint(self, path: PathLike, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """Write ``state`` (modules, optimizers and stateful objects as their state_dicts; ``filter`` keeps some
        entries) to ``path`` through ``checkpoint_io`` on global rank 0, ``storage_options`` passed to it. Call on
        every rank; every rank returns once the plugin returned and raises if it raised
        (``fabriclite.checkpoint.saving``)."""
        save_checkpoint(self, path, state, filter=filter, storage_options=storage_options)

    def load_checkpoint(self, path: PathLike, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Restore ``state`` (a dict of objects, a module, an optimizer) in place from ``path``; returns what was
        not restored (the whole checkpoint for ``state`` None / empty). Call on every rank
        (``fabriclite.checkpoint.saving.load_checkpoint``)."""
        return load_checkpoint(self, path, state, strict=strict, weights_only=weights_only)

    def checkpoint_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """The checkpoint (module / optimizer state already taken) as it will be written; XLA syncs and
        moves tensors to the CPU. Default: as is. Saving itself lives in ``fabriclite.checkpoint.saving``."""
        return state

    def checkpoint_writer(self, state: Dict[str, Any], filter: Optional[Dict[str, Any]]) -> Optional[Any]:
        """For checkpoints that every rank writes (a sharded strategy's directory): an object whose
        ``write(directory)`` runs on every rank inside ``fabriclite.checkpoint.saving``'s atomic protocol. None (the
        default): one file of ``checkpoint_state(...)`` written by global rank 0."""
        return None

    def get_module_state_dict(self, module: nn.Module) -> Dict[str, Any]:
        """``module``'s full state_dict as it should be saved (sharded strategies gather it)."""
        return module.state_dict()

    def load_module_state_dict(self, module: nn.Module, state_dict: Dict[str, Any], strict: bool = True) -> None:
        module.load_state_dict(state_dict, strict=strict)

    def get_optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        """``optimizer``'s state_dict as it should be saved (a sharded optimizer is consolidated; ranks
        other than 0 then get ``{}``)."""
        if hasattr(optimizer, "consolidate_state_dict"):
            optimizer.consolidate_state_dict()
            return optimizer.state_dict() if self.is_global_zero else {}
        return optimizer.state_dict()

    def teardown(self) -> None:
        """Wait for checkpoints still being written (raising the error of one that failed, after the rest of the
        teardown), leave the group and release the device; safe to call twice."""
        try:
            self.wait_for_checkpoints()
        finally:
            self.precision.teardown()
            if self.accelerator is not None:
                self.accelerator.teardown()
            if self._checkpoint_io is not None:
                self._checkpoint_io.teardown()

    # ------------------------------------------------------------------ Lightning's collective methods
    # What user code and a LightningModule call on ``fabric.strategy``, with Lightning's signatures. Each is
    # one collection-aware collective (``fabriclite.collectives``) built on the flat primitives below.
    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """``tensor`` (or a nested collection) reduced over ``group`` (default: all ranks); a new result, the
        input unchanged. Same as ``fabric.all_reduce``."""
        return collectives.all_reduce(self, tensor, group=group, reduce_op=reduce_op)

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's ``tensor`` stacked on a new dim 0 (``(world_size, *shape)``; one process: as is).
        ``sync_grads=True`` lets gradients flow back to each rank's input. Same as ``fabric.all_gather``."""
        return collectives.all_gather(self, tensor, group=group, sync_grads=sync_grads)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Global rank ``src``'s ``obj`` (any picklable object; tensors travel as tensors) on every rank."""
        return collectives.broadcast(self, obj, src)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """True on every rank when every rank's ``decision`` is true (``all=True``) or when any is (``all=False``).
        One small all_reduce; the same answer on every rank."""
        votes = int(collectives.all_reduce(self, int(bool(decision)), reduce_op="sum"))
        return votes == self.world_size if all else votes > 0

    # ------------------------------------------------------------------ primitives
    def resolve_group(self, group: Any) -> Any:
        """A process-group handle for ``group`` (None: the world; a list of ranks: a cached group)."""
        if group is None:
            return None
        raise ValueError(f"group={group!r}: {type(self).__name__} runs a single process and has no groups.")

    def group_size(self, group: Any = None) -> int:
        return self.world_size

    def group_rank(self, group: Any = None) -> int:
        return self.global_rank

    def group_ranks(self, group: Any = None) -> List[int]:
        """Global ranks of ``group``'s members, in group-rank order."""
        return list(range(self.world_size))

    def flat_all_reduce(self, tensor: Tensor, op: str = "sum", group: Any = None) -> Tensor:
        return tensor

    def flat_all_reduce_copy(self, out: Tensor, tensor: Tensor, op: str = "sum", group: Any = None,
                        divisor: Optional[int] = None) -> Tensor:
        """``out`` (flat, contiguous, ``tensor``'s numel and dtype) set to the reduction over the group of
        ``tensor`` (divided by ``divisor`` first when given); ``tensor`` is left unchanged, unless it is ``out``
        itself (then it is divided and reduced in place, as ``flat_all_reduce`` would after a division). Returns the
        result, ``out`` itself unless the strategy's all_reduce returns a new tensor. Strategies that can
        overlap the copy with the reduction override this."""
        copy_into(out, tensor, divisor)
        return self.flat_all_reduce(out, op, group)

    def flat_all_gather(self, tensor: Tensor, group: Any = None) -> Tensor:
        return tensor.unsqueeze(0)

    def flat_all_gather_into(self, out: Tensor, tensor: Tensor, group: Any = None) -> Tensor:
        """``all_gather`` written into ``out`` (contiguous, ``(group_size, *shape)``, ``tensor``'s dtype);
        returns ``out``. Lets a caller reuse a large output buffer (no fresh pages per call); strategies
        that can gather into it directly override this."""
        out.copy_(self.flat_all_gather(tensor, group))
        return out

    def flat_broadcast(self, tensor: Tensor, src: int = 0, group: Any = None) -> Tensor:
        return tensor

    def all_gather_object(self, obj: Any, group: Any = None) -> List[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0, group: Any = None) -> Any:
        return obj

    def barrier(self, name: Optional[str] = None, group: Any = None) -> None:
        pass

    @property
    def store(self) -> Optional[Any]:
        """The job's key-value store (a c10d Store) when there is one: used for waits without a
        deadline (rank_zero_first, checkpoint writes) and for failure flags."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(accelerator={self.accelerator!r}, precision={self.precision!r})"


def _params(optimizer: Optimizer) -> Iterator[Tensor]:
    return (p for group in optimizer.param_groups for p in group["params"])


def copy_into(out: Tensor, tensor: Tensor, divisor: Optional[int] = None) -> None:
    """``out[:] = tensor.reshape(-1)``, divided by ``divisor`` when given (one pass on one device)."""
    if divisor is not None and tensor.device == out.device:
        torch.div(tensor.reshape(-1), divisor, out=out)
        return
    out.copy_(tensor.reshape(-1))
    if divisor is not None:
        out.div_(divisor)
