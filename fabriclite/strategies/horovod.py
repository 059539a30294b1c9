"""Horovod: ranks started by ``horovodrun`` (never by fabriclite); collectives over ``horovod.torch``.

horovod is imported only when the strategy is set up or used, never when fabriclite is imported.
"""
from __future__ import annotations

import contextlib
import os
import types
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from fabriclite.collectives import object_wire
from fabriclite.collectives.ops import BITWISE_OPS, check_native_reduce, reduce_rows_bitwise
from fabriclite.strategies.parallel import ParallelStrategy

INSTALL_RECIPE = (
    "`make env-horovod` (builds horovod 0.28.1 into a cached venv), or by hand: download the sdist with "
    "`pip download --no-binary :all: --no-deps horovod==0.28.1`, set CMAKE_CXX_STANDARD to 17 in CMakeLists.txt and "
    "horovod/torch/CMakeLists.txt, then `HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 pip install "
    "--no-build-isolation ./horovod-0.28.1`; see docs/backends.md"
)
#: Horovod's own reductions; band/bor/bxor are emulated with an all-gather and a local reduction.
_HVD_OPS = {"sum": "Sum", "min": "Min", "max": "Max", "prod": "Product"}
#: dtypes Horovod's reductions reject, and the dtype they are reduced in (exact: modular for the integers)
_REDUCE_AS = {torch.bool: torch.int32, torch.uint8: torch.int32, torch.int8: torch.int32,
              torch.int16: torch.int32, torch.bfloat16: torch.float32}
#: dtypes Horovod cannot move at all, and a same-size dtype to view them as
_MOVE_AS = {torch.bool: torch.uint8, torch.bfloat16: torch.int16}


def import_horovod() -> Any:
    """``horovod.torch``; ModuleNotFoundError with the install recipe when it is missing or built without torch."""
    try:
        import horovod.torch as hvd
    except ImportError as err:
        raise ModuleNotFoundError(
            f"strategy='horovod' needs horovod with PyTorch support, which cannot be imported ({err}). "
            f"Install it with {INSTALL_RECIPE}."
        ) from None
    return hvd


class HorovodStrategy(ParallelStrategy):
    """Data-parallel over Horovod: run the script with ``horovodrun -np N [-H host:n,...] [--gloo] python script.py``.

    ``launch()`` only joins (``hvd.init()``); ranks come from Horovod (``HOROVOD_*`` variables before that).
    ``setup_module`` broadcasts parameters and buffers from rank 0; ``setup_optimizer`` returns an
    ``hvd.DistributedOptimizer`` (named after the set-up modules' parameters) with its state broadcast from rank 0.
    ``process_sets``: lists of global ranks registered on every rank at start-up (Horovod cannot create a set on
    only its members later); ``group=`` in a collective must name one of them, or be a ``hvd.ProcessSet``.
    """

    name = "horovod"

    def __init__(self, accelerator: Any = None, precision: Any = None, cluster_environment: Any = None,
                 process_sets: Optional[Sequence[Sequence[int]]] = None) -> None:
        super().__init__(accelerator=accelerator, precision=precision, cluster_environment=cluster_environment)
        self._set_ranks: List[Tuple[int, ...]] = [tuple(sorted(int(r) for r in s)) for s in (process_sets or [])]
        self._process_sets: Dict[Tuple[int, ...], Any] = {}
        self._modules: List[nn.Module] = []
        self._optimizers: List[Optimizer] = []
        self._skip_sync = False

    # ------------------------------------------------------------------ where this rank is
    def _hvd(self) -> Any:
        hvd = import_horovod()
        if not hvd.is_initialized():
            raise RuntimeError("Horovod is not initialized yet: call fabric.launch() first (under horovodrun).")
        return hvd

    def _fact(self, fn: str, var: str, default: int) -> int:
        hvd = import_horovod()
        if hvd.is_initialized():
            return int(getattr(hvd, fn)())
        return int(os.environ.get(var, default))

    @property
    def root_device(self) -> torch.device:
        if getattr(self.accelerator, "name", "cpu") in ("cuda", "gpu"):
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def world_size(self) -> int:
        return self._fact("size", "HOROVOD_SIZE", 1)

    @property
    def global_rank(self) -> int:
        return self._fact("rank", "HOROVOD_RANK", 0)

    @property
    def local_rank(self) -> int:
        return self._fact("local_rank", "HOROVOD_LOCAL_RANK", 0)

    @property
    def node_rank(self) -> int:
        return self._fact("cross_rank", "HOROVOD_CROSS_RANK", 0)

    @property
    def num_nodes(self) -> int:
        return self._fact("cross_size", "HOROVOD_CROSS_SIZE", 1)

    def local_world_size(self) -> int:
        return self._fact("local_size", "HOROVOD_LOCAL_SIZE", 1)

    @property
    def distributed_ready(self) -> bool:
        return import_horovod().is_initialized()

    # ------------------------------------------------------------------ set-up
    def setup_environment(self) -> None:
        hvd = import_horovod()
        if not hvd.is_initialized():
            sets = [hvd.ProcessSet(list(r)) for r in self._set_ranks]
            hvd.init(process_sets=sets)
            self._process_sets = {r: s for r, s in zip(self._set_ranks, sets)}
        super().setup_environment()

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Every rank gets rank 0's parameters and buffers; the module itself is returned unwrapped."""
        self._hvd().broadcast_parameters(module.state_dict(), root_rank=0)
        self._modules.append(module)
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """An ``hvd.DistributedOptimizer`` over ``optimizer``'s parameter groups and state (shared, not copied);
        gradients are averaged over the ranks during backward; state is broadcast from rank 0."""
        hvd = self._hvd()
        if hasattr(optimizer, "synchronize") and hasattr(optimizer, "_allreduce_delay"):
            return optimizer  # already distributed
        wrapped = hvd.DistributedOptimizer(optimizer, named_parameters=self._named_parameters(optimizer),
                                           backward_passes_per_step=1, op=hvd.Average)
        wrapped.state = optimizer.state
        wrapped.zero_grad = types.MethodType(_zero_grad, wrapped)  # horovod's takes no set_to_none
        has_state = torch.tensor([int(bool(optimizer.state))], dtype=torch.int32)
        # broadcast_optimizer_state takes an optimizer step to create missing state: only broadcast real state
        if hvd.allreduce(has_state, op=hvd.Max, name="fabriclite.optimizer_has_state").item():
            hvd.broadcast_optimizer_state(wrapped, root_rank=0)
        self._optimizers.append(wrapped)
        return wrapped

    def _named_parameters(self, optimizer: Optimizer) -> List[Tuple[str, nn.Parameter]]:
        """Horovod's collective names for ``optimizer``'s parameters (equal on every rank): their names in the most
        recently set-up module holding them, prefixed by that module's set-up index only where names collide."""
        plain: Dict[nn.Parameter, str] = {}
        prefixed: Dict[nn.Parameter, str] = {}
        for i in reversed(range(len(self._modules))):
            for name, param in self._modules[i].named_parameters():
                plain.setdefault(param, name)
                prefixed.setdefault(param, f"module{i}.{name}")
        params = [(g, j, p) for g, group in enumerate(optimizer.param_groups) for j, p in enumerate(group["params"])]
        names = [plain.get(p, f"param_group.{g}.{j}") for g, j, p in params]
        if len(set(names)) < len(names):
            names = [prefixed.get(p, f"param_group.{g}.{j}") for g, j, p in params]
        return [(name, p) for name, (_, _, p) in zip(names, params)]

    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        """Backward; inside ``no_backward_sync`` the gradients accumulate locally and are averaged with the next
        synchronised backward (or at the optimizer step)."""
        if self._skip_sync:
            for opt in self._optimizers:  # one more pass before each parameter's all-reduce fires
                for p in opt._requires_update:
                    opt._allreduce_delay[p] += 1
        super().backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Waits for the gradient all-reduces, then steps through the precision plugin (once, no second sync)."""
        if not hasattr(optimizer, "skip_synchronize"):
            return super().optimizer_step(optimizer, **kwargs)
        _synchronize(optimizer)
        with optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """Clips the averaged gradients (the all-reduces are awaited first, as Horovod requires)."""
        _synchronize(optimizer)
        return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float) -> None:
        _synchronize(optimizer)
        super().clip_gradients_value(module, optimizer, clip_val)

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        previous, self._skip_sync = self._skip_sync, True
        try:
            yield
        finally:
            self._skip_sync = previous

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager:
        """Backward passes inside the block do not communicate (Horovod's ``backward_passes_per_step``)."""
        return self._no_sync() if enabled else contextlib.nullcontext()

    def teardown(self) -> None:
        self._modules.clear()
        self._optimizers.clear()
        super().teardown()

    # ------------------------------------------------------------------ primitives
    def resolve_group(self, group: Any) -> Any:
        """None (every rank), a registered ``hvd.ProcessSet``, or the ranks of one given to ``process_sets``."""
        if group is None or type(group).__name__ == "ProcessSet":
            return group
        if isinstance(group, (list, tuple, range)):
            ranks = tuple(sorted(int(r) for r in group))
            if ranks in self._process_sets:
                return self._process_sets[ranks]
            if ranks == tuple(range(self.world_size)):
                return None
            raise ValueError(
                f"group={list(group)!r} is not a Horovod process set of this job. Horovod registers process sets on "
                f"every rank when it starts, so name them up front: Fabric(strategy=HorovodStrategy(process_sets="
                f"[{list(ranks)!r}])). Registered: {[list(r) for r in self._process_sets] or 'none'}."
            )
        raise TypeError(f"group={group!r}: expected None, a list of ranks or a horovod ProcessSet.")

    def _set(self, group: Any) -> Any:
        group = self.resolve_group(group)
        return self._hvd().global_process_set if group is None else group

    def group_size(self, group: Any = None) -> int:
        return int(self._set(group).size())

    def group_rank(self, group: Any = None) -> int:
        return int(self._set(group).rank())

    def group_ranks(self, group: Any = None) -> List[int]:
        ranks = self._set(group).ranks
        return list(ranks) if ranks is not None else list(range(self.world_size))

    def flat_all_reduce(self, tensor: Tensor, op: str = "sum", group: Any = None) -> Tensor:
        """Every member gets the reduction. sum/min/max/prod run in Horovod (bool, 8/16-bit ints and bfloat16 in
        a wider dtype, complex sums as real pairs); band/bor/bxor are an all-gather and a local reduction."""
        hvd, pset = self._hvd(), self._set(group)
        if op in BITWISE_OPS:
            return reduce_rows_bitwise(self.flat_all_gather(tensor, group), op).to(tensor.dtype)
        check_native_reduce("horovod", op, _HVD_OPS, tensor)
        if tensor.is_complex():
            out = hvd.allreduce(torch.view_as_real(tensor), op=hvd.Sum, name="fabriclite.all_reduce", process_set=pset)
            return torch.view_as_complex(out.contiguous())
        wire = tensor.to(_REDUCE_AS.get(tensor.dtype, tensor.dtype))
        out = hvd.allreduce(wire, op=getattr(hvd, _HVD_OPS[op]), name="fabriclite.all_reduce", process_set=pset)
        return out.to(tensor.dtype) if tensor.dtype is not torch.bool else out != 0

    def flat_all_gather(self, tensor: Tensor, group: Any = None) -> Tensor:
        """``(group_size, *shape)``; shapes must be equal on every member (Horovod checks all but dim 0)."""
        wire = _to_movable(tensor.unsqueeze(0))
        out = self._hvd().allgather(wire, name="fabriclite.all_gather", process_set=self._set(group))
        return _from_movable(out, tensor.dtype)

    def flat_broadcast(self, tensor: Tensor, src: int = 0, group: Any = None) -> Tensor:
        """``src``'s tensor (``src`` a global rank) on every member."""
        out = self._hvd().broadcast(_to_movable(tensor), root_rank=src, name="fabriclite.broadcast",
                                    process_set=self._set(group))
        return _from_movable(out, tensor.dtype)

    def all_gather_object(self, obj: Any, group: Any = None) -> List[Any]:
        """Every member's ``obj`` in group-rank order, loaded with fabriclite's restricted unpickler."""
        return object_wire.all_gather_objects(obj, lambda t: self.flat_all_gather(t, group), torch.device("cpu"))

    def broadcast_object(self, obj: Any, src: int = 0, group: Any = None) -> Any:
        """``src``'s ``obj`` (``src`` a global rank) on every member, loaded with fabriclite's restricted unpickler
        (not Horovod's ``broadcast_object``, which unpickles anything)."""
        return object_wire.broadcast_object(obj, self.global_rank == src, lambda t: self.flat_broadcast(t, src, group),
                                            torch.device("cpu"))

    def barrier(self, name: Optional[str] = None, group: Any = None) -> None:
        self._hvd().barrier(process_set=self._set(group))


def _zero_grad(optimizer: Optimizer, set_to_none: bool = True) -> None:
    """``Optimizer.zero_grad(set_to_none)``, refused (as Horovod does) while gradient all-reduces are in flight."""
    if any(handle is not None for handle, _ in optimizer._handles.values()):
        raise AssertionError("optimizer.zero_grad() was called after backward but before optimizer.step(): the "
                             "gradient all-reduces are still running. Step (or synchronize) first.")
    torch.optim.Optimizer.zero_grad(optimizer, set_to_none=set_to_none)


def _synchronize(optimizer: Optimizer) -> None:
    """Wait for ``optimizer``'s gradient all-reduces unless that already happened since its last step."""
    if hasattr(optimizer, "synchronize") and not getattr(optimizer, "_synchronized", False):
        optimizer.synchronize()


def _to_movable(tensor: Tensor) -> Tensor:
    if tensor.is_complex():
        return torch.view_as_real(tensor.contiguous())
    view = _MOVE_AS.get(tensor.dtype)
    return tensor.contiguous().view(view) if view is not None else tensor.contiguous()


def _from_movable(tensor: Tensor, dtype: torch.dtype) -> Tensor:
    if dtype.is_complex:
        return torch.view_as_complex(tensor.contiguous())
    return tensor.view(dtype) if dtype in _MOVE_AS else tensor
