"""XLA (TPU, or XLA's CPU devices for testing): one replica per device, collectives through ``torch_xla``.

torch_xla is imported only inside methods. Every collective first materialises pending work, then runs a graph
that holds only the collective, and materialises again; those syncs are serialised within a process, because
when one process drives several devices (one thread each) XLA requires every thread to run the same compiled
collective at the same time.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any, ContextManager, Dict, List, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from fabriclite.accelerators.xla import import_xla
from fabriclite.checkpoint.checkpoint_io import CheckpointIO
from fabriclite.collectives import object_wire
from fabriclite.collectives.ops import BITWISE_OPS, check_native_reduce, reduce_rows_bitwise
from fabriclite.strategies.parallel import ParallelStrategy
from fabriclite.strategies.single_device import SingleDeviceStrategy

_SYNC_LOCK = threading.Lock()
#: fabriclite op -> xm reduce type; the bitwise ops are an all-gather and a local reduction (XLA has no xor, and
#: its CPU backend rejects and/or reductions)
_XM_OPS = {"sum": "sum", "prod": "mul", "min": "min", "max": "max"}
#: dtypes XLA's CPU all-reduce rejects, and the dtype they are reduced in (exact: modular for the integers)
_REDUCE_AS = {torch.bool: torch.int32, torch.int8: torch.int32, torch.int16: torch.int32,
              torch.bfloat16: torch.float32, torch.float16: torch.float32}
#: same-size integer views, so that a summed zero-padded gather returns every bit unchanged
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16, torch.bool: torch.uint8}


def xla_sync() -> None:
    """Run every pending XLA graph of this thread (``torch_xla.sync``), one thread of this process at a time."""
    xm = import_xla()
    with _SYNC_LOCK:
        xm.mark_step()


def _launch(tensors: List[Tensor]) -> None:
    """Compile and start the graph of ``tensors`` alone (not every live tensor, as ``mark_step`` would), one thread
    at a time, without waiting: each replica's graph is then the same collective, compiled once per process."""
    import torch_xla

    with _SYNC_LOCK:
        torch_xla._XLAC._xla_sync_multi(tensors, devices=[], wait=False)


def _to_cpu(data: Any) -> Any:
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(data, Tensor, lambda t: t.detach().cpu() if t.device.type == "xla" else t)


class _XLAMixin:
    """What single- and multi-device XLA share: the optimizer step, no-op gradient sync, checkpoints on the CPU."""

    precision: Any
    root_device: torch.device

    def module_to_device(self, module: nn.Module) -> nn.Module:
        """Moves ``module``; XLA copies parameters rather than moving them in place, so the copies are remembered
        and optimizers set up next are pointed at them (and their state re-keyed)."""
        before = dict(module.named_parameters())
        module = module.to(self.root_device)
        after = dict(module.named_parameters())
        self._moved_params = {old: after[name] for name, old in before.items() if name in after}
        return module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        moved = getattr(self, "_moved_params", {})
        for group in optimizer.param_groups:
            group["params"] = [moved.get(p, p) for p in group["params"]]
        state = dict(optimizer.state)
        optimizer.state.clear()
        optimizer.state.update({moved.get(p, p): v for p, v in state.items()})
        return optimizer

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """``xm.optimizer_step`` (gradients averaged over the replicas, then the step), then a sync."""
        result = import_xla().optimizer_step(optimizer, optimizer_args=kwargs)
        xla_sync()
        return result

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> ContextManager:
        """Nothing to skip: XLA reduces gradients only in the optimizer step, so they accumulate locally anyway."""
        return nullcontext()

    def get_module_state_dict(self, module: nn.Module) -> Dict[str, Any]:
        xla_sync()
        return _to_cpu(module.state_dict())

    def get_optimizer_state(self, optimizer: Optimizer) -> Dict[str, Any]:
        xla_sync()
        return _to_cpu(optimizer.state_dict())

    def checkpoint_state(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """Pending work is run on every replica and tensors move to the CPU (global rank 0 writes once)."""
        xla_sync()
        return _to_cpu(state)


class SingleDeviceXLAStrategy(_XLAMixin, SingleDeviceStrategy):
    """One process on one XLA device (``devices=1`` or ``[i]``); collectives are identities."""

    name = "single_xla"

    def __init__(self, device: Union[int, str, torch.device] = 0, accelerator: Any = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision: Any = None, **kwargs: Any) -> None:
        import_xla()
        index = device if isinstance(device, int) else (torch.device(device).index or 0)
        super().__init__(device=torch.device("xla", index), accelerator=accelerator, checkpoint_io=checkpoint_io,
                         precision=precision, **kwargs)

    def process_dataloader(self, dataloader: Any) -> Any:
        return _device_loader(dataloader, self.root_device)


class XLAStrategy(_XLAMixin, ParallelStrategy):
    """One replica per XLA device, started by the XLA launcher (``xmp.spawn``); ``launch(fn)`` returns rank 0's
    result. Ranks come from the XLA runtime after launch (before: rank 0 of ``num_processes``). ``group=`` is not
    supported: XLA collectives always span every replica. ``sync_module_states``: broadcast rank 0's parameters
    in ``setup_module``."""

    name = "xla"

    def __init__(self, accelerator: Any = None, parallel_devices: Optional[List[torch.device]] = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision: Any = None, sync_module_states: bool = True,
                 cluster_environment: Any = None) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices, checkpoint_io=checkpoint_io,
                         precision=precision, cluster_environment=cluster_environment)
        import_xla()
        self.sync_module_states = sync_module_states
        self._launched = False

    @property
    def num_processes(self) -> int:
        """Replicas on this host: every XLA device (``xmp.spawn`` cannot start fewer than all but one)."""
        if self.parallel_devices:
            return len(self.parallel_devices)
        return self.accelerator.auto_device_count() if self.accelerator is not None else 1

    @property
    def root_device(self) -> torch.device:
        if not self._launched:
            return torch.device("xla", 0)
        import torch_xla

        return torch_xla.device()

    def _runtime(self, fn: str, before: int) -> int:
        if not self._launched:
            return before
        from torch_xla import runtime as xr

        return int(getattr(xr, fn)())

    @property
    def world_size(self) -> int:
        return self._runtime("world_size", self.num_processes)

    @property
    def global_rank(self) -> int:
        return self._runtime("global_ordinal", 0)

    @property
    def local_rank(self) -> int:
        return self._runtime("local_ordinal", 0)

    @property
    def node_rank(self) -> int:
        return self._runtime("host_index", 0)

    def local_world_size(self) -> int:
        return self.num_processes

    @property
    def distributed_ready(self) -> bool:
        return self._launched

    @property
    def launcher(self) -> Any:
        if self._launcher is None:
            from fabriclite.launchers.xla import XLALauncher

            self._launcher = XLALauncher(self)
        return self._launcher

    def setup_environment(self) -> None:
        self._launched = True
        super().setup_environment()

    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.sync_module_states and self.world_size > 1:
            import_xla().broadcast_master_param(module)
            xla_sync()
        return module

    def process_dataloader(self, dataloader: Any) -> Any:
        return _device_loader(dataloader, self.root_device)

    def all_reduce(self, output: Any, group: Any = None, reduce_op: Any = None) -> Any:
        """Lightning's XLA signature: ``reduce_op=None`` sums (Lightning's XLA default), "mean" averages;
        otherwise the base strategy's ``all_reduce`` (a new result, the input unchanged)."""
        return super().all_reduce(output, group=group, reduce_op="sum" if reduce_op is None else reduce_op)

    # ------------------------------------------------------------------ primitives
    def resolve_group(self, group: Any) -> Any:
        if group is None or (isinstance(group, (list, tuple, range))
                             and sorted(int(r) for r in group) == list(range(self.world_size))):
            return None
        raise ValueError(f"group={group!r}: XLA collectives always span every replica; subgroups are not "
                         "supported by the xla strategy. Use group=None.")

    def _reduce(self, tensor: Tensor, op: str) -> Tensor:
        """``xm.all_reduce`` of a materialised copy of ``tensor`` in a graph of its own; the result on the CPU."""
        xm = import_xla()
        with _SYNC_LOCK:  # runs the pending work that made ``tensor`` in a graph without collectives
            data = tensor.detach().cpu()
        out = xm.all_reduce(_XM_OPS[op], data.to(self.root_device))
        _launch([out])
        return out.cpu()  # waits for the other replicas: never under the lock

    def flat_all_reduce(self, tensor: Tensor, op: str = "sum", group: Any = None) -> Tensor:
        """Every replica gets the reduction, on ``tensor``'s device: sum, prod, min, max in XLA (bool, 8/16-bit
        ints and 16-bit floats in a wider dtype, complex sums as real pairs); band, bor, bxor emulated with an
        all-gather and a local reduction."""
        self.resolve_group(group)
        if op in BITWISE_OPS:
            return reduce_rows_bitwise(self.flat_all_gather(tensor), op)
        check_native_reduce("xla", op, _XM_OPS, tensor)
        if tensor.is_complex():
            out = torch.view_as_complex(self._reduce(torch.view_as_real(tensor), op).contiguous())
        else:
            out = self._reduce(tensor.to(_REDUCE_AS.get(tensor.dtype, tensor.dtype)), op)
            out = out != 0 if tensor.dtype is torch.bool else out.to(tensor.dtype)
        return out.to(tensor.device)

    def flat_all_gather(self, tensor: Tensor, group: Any = None) -> Tensor:
        """``(world_size, *shape)`` on ``tensor``'s device; shapes must be equal on every replica. With one device
        per process this is ``xm.all_gather``; where a process drives several devices (threads), XLA only keeps
        all-reduces in step, so each replica's bits go into its own row of a zero buffer that is summed (exact)."""
        self.resolve_group(group)
        from torch_xla import runtime as xr

        if xr.addressable_device_count() == 1:
            xm = import_xla()
            with _SYNC_LOCK:
                data = tensor.detach().cpu()
            out = xm.all_gather(data.unsqueeze(0).to(self.root_device), dim=0)
            _launch([out])
            return out.cpu().to(tensor.device)
        bits = _bits(tensor.detach().cpu())
        rows = torch.zeros((self.world_size, *bits.shape), dtype=bits.dtype)
        rows[self.global_rank] = bits
        return _unbits(self._reduce(rows, "sum"), tensor.dtype).to(tensor.device)

    def flat_broadcast(self, tensor: Tensor, src: int = 0, group: Any = None) -> Tensor:
        """``src``'s tensor on every replica (gathered and selected: exact for every dtype and value)."""
        return self.flat_all_gather(tensor, group)[src]

    def all_gather_object(self, obj: Any, group: Any = None) -> List[Any]:
        """Every replica's ``obj`` in rank order, loaded with fabriclite's restricted unpickler."""
        return object_wire.all_gather_objects(obj, lambda t: self.flat_all_gather(t, group), torch.device("cpu"))

    def broadcast_object(self, obj: Any, src: int = 0, group: Any = None) -> Any:
        """``src``'s ``obj`` on every replica, loaded with fabriclite's restricted unpickler; the others' objects
        are not sent."""
        return object_wire.broadcast_object(obj, self.global_rank == src, lambda t: self.flat_broadcast(t, src, group),
                                            torch.device("cpu"))

    def barrier(self, name: Optional[str] = None, group: Any = None) -> None:
        self.flat_all_reduce(torch.zeros(1), "sum", group)


def _bits(tensor: Tensor) -> Tensor:
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    return tensor.contiguous().view(_BITS[tensor.dtype]) if tensor.dtype in _BITS else tensor


def _unbits(bits: Tensor, dtype: torch.dtype) -> Tensor:
    if dtype.is_complex:
        real = torch.float64 if dtype == torch.complex128 else torch.float32
        return torch.view_as_complex(bits.view(real).contiguous())
    return bits.view(dtype) if dtype in _BITS else bits


def _device_loader(dataloader: Any, device: torch.device) -> Any:
    """``dataloader`` wrapped in torch_xla's ``MpDeviceLoader`` (batches prefetched onto ``device``)."""
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    if isinstance(dataloader, MpDeviceLoader):
        return dataloader
    loader = MpDeviceLoader(dataloader, device)
    loader.dataset = dataloader.dataset  # the DataLoader attributes callers look for
    loader.batch_sampler = getattr(dataloader, "batch_sampler", None)
    loader.sampler = getattr(dataloader, "sampler", None)
    return loader
