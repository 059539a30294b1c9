"""The Strategy seam: how processes cooperate.

A strategy owns set-up (process group, module / optimizer wrapping, device moves) and exposes a few
collective *primitives* on flat tensors and Python objects. Everything a user calls on collections
(``fabriclite.collectives``) is written once on top of these primitives.

Primitive contract (every strategy):

- ``all_reduce(tensor, op, group)``: every rank gets the reduction; ``op`` is one of
  ``supported_reduce_ops`` ("sum", "min", "max", "prod", "band", "bor", "bxor"). May work in place on
  ``tensor`` (callers pass a buffer they own) and returns the result.
- ``all_gather(tensor, group)``: equal shapes on every rank; returns ``(group_size, *shape)``.
- ``broadcast(tensor, src, group)``: ``src`` is a global rank; returns the tensor of ``src``
  (same shape and dtype on every rank).
- ``all_gather_object(obj, group)`` -> list in group-rank order; ``broadcast_object(obj, src, group)``.
- ``barrier(name, group)``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, ContextManager, FrozenSet, List, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from fabriclite.accelerators.base import Accelerator
from fabriclite.precision import Precision

if TYPE_CHECKING:
    from fabriclite.environments.base import ClusterEnvironment
    from fabriclite.launchers.base import Launcher

ALL_REDUCE_OPS: FrozenSet[str] = frozenset({"sum", "min", "max", "prod", "band", "bor", "bxor"})


class Strategy(ABC):
    """Base strategy. The connector fills ``accelerator``, ``precision`` and ``cluster_environment``."""

    name: str = "base"
    supported_reduce_ops: FrozenSet[str] = ALL_REDUCE_OPS

    def __init__(
        self,
        accelerator: Optional[Accelerator] = None,
        precision: Optional[Precision] = None,
        cluster_environment: Optional["ClusterEnvironment"] = None,
    ) -> None:
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
        """Per rank, after launch: claim the device (and, for parallel strategies, join the group)."""
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

    def module_init_context(self) -> ContextManager:
        return self.precision.module_init_context()

    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        self.precision.backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        return self.precision.optimizer_step(optimizer, **kwargs)

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """Skip gradient synchronisation inside the block; a no-op for one process."""
        return nullcontext()

    def teardown(self) -> None:
        """Leave the group and release the device; safe to call twice."""
        if self.accelerator is not None:
            self.accelerator.teardown()

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

    def all_reduce(self, tensor: Tensor, op: str = "sum", group: Any = None) -> Tensor:
        return tensor

    def all_gather(self, tensor: Tensor, group: Any = None) -> Tensor:
        return tensor.unsqueeze(0)

    def broadcast(self, tensor: Tensor, src: int = 0, group: Any = None) -> Tensor:
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
