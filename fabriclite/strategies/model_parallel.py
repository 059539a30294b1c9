"""ModelParallelStrategy: the user's ``parallelize_fn`` applies tensor parallelism and/or FSDP2 over a 2-D device
mesh (data_parallel x tensor_parallel), as in Lightning's ModelParallelStrategy.

It shares fsdp's processes, collectives, set-up and checkpoint code (``ShardedStrategy``); what is its own: the
2-D mesh, ``setup_module`` calling ``parallelize_fn(module, mesh)``, and dataloaders sharded over the
data-parallel dimension only (every rank of a tensor-parallel group sees the same batches).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Dict, Literal, Optional, Union

from torch import nn

from fabriclite.strategies import fsdp2 as sharding
from fabriclite.strategies.sharded_base import ShardedStrategy

MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")


class ModelParallelStrategy(ShardedStrategy):
    """User-defined parallelism (FSDP2 and/or tensor parallel) over a ``(data_parallel_size, tensor_parallel_size)``
    mesh whose dims are named "data_parallel" and "tensor_parallel".

    ``parallelize_fn(module, device_mesh) -> module``. ``data_parallel_size`` "auto": the number of nodes;
    ``tensor_parallel_size`` "auto": the processes per node; their product must be the world size.
    ``save_distributed_checkpoint``: True writes a torch.distributed.checkpoint directory (+ ``meta.pt``), False one
    full file from rank 0. ``async_save=True`` (fabriclite's): checkpoints are written in the background
    (``fabriclite.checkpoint.async_save``).
    """

    name = "model_parallel"

    def __init__(
        self,
        parallelize_fn: Callable[[Any, Any], Any],
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        tensor_parallel_size: Union[Literal["auto"], int] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Union[None, float, timedelta] = None,
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        if not callable(parallelize_fn):
            raise TypeError(f"parallelize_fn={parallelize_fn!r} is not callable; expected a function "
                            "(module, device_mesh) -> module.")
        for name, size in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise ValueError(f"{name}={size!r}: expected 'auto' or an int >= 1.")
        self._parallelize_fn = parallelize_fn
        self._data_parallel_size = data_parallel_size
        self._tensor_parallel_size = tensor_parallel_size
        self.sharded_checkpoints = bool(save_distributed_checkpoint)
        self._init_sharded(async_save)

    def check_configuration(self, accelerator: str, world_size: int) -> None:
        """ValueError before anything starts: an accelerator FSDP2 / DTensor do not run on here, or sizes whose
        product is not the world size."""
        if accelerator not in ("cpu", "cuda", "gpu"):
            raise ValueError(f"strategy={self.name!r} runs on cpu (gloo) or cuda (nccl); accelerator={accelerator!r} "
                             "is not supported.")
        dp, tp = self._data_parallel_size, self._tensor_parallel_size
        if dp != "auto" and tp != "auto" and dp * tp != world_size:
            raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} = {dp * tp}, but the world size is "
                             f"{world_size}; their product must equal it.")

    def setup_environment(self) -> None:
        super().setup_environment()
        from torch.distributed.device_mesh import init_device_mesh

        dp = self.num_nodes if self._data_parallel_size == "auto" else self._data_parallel_size
        tp = self.num_processes if self._tensor_parallel_size == "auto" else self._tensor_parallel_size
        if dp * tp != self.world_size:
            raise ValueError(f"data_parallel_size={dp} x tensor_parallel_size={tp} must equal the world size "
                             f"({self.world_size}).")
        self._data_parallel_size, self._tensor_parallel_size = dp, tp
        self._device_mesh = init_device_mesh(self.root_device.type, (dp, tp), mesh_dim_names=MESH_DIM_NAMES)

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, int]:
        """Shards over the data-parallel dimension only: the ranks of a tensor-parallel group get the same batches."""
        dp = self.device_mesh["data_parallel"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    def setup_module(self, module: nn.Module) -> nn.Module:
        """``parallelize_fn(module, device_mesh)``, then materialised (``reset_parameters``) if it was built on the
        meta device. TypeError for FSDP1 wrappers or a function that does not return a module."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            raise TypeError("The module holds torch.distributed.fsdp.FullyShardedDataParallel (FSDP1) wrappers; "
                            f"{type(self).__name__} supports FSDP2 (fully_shard) and tensor parallelism only.")
        module = self._parallelize_fn(module, self.device_mesh)
        if not isinstance(module, nn.Module):
            raise TypeError(f"parallelize_fn must return the nn.Module; it returned {type(module).__name__}.")
        sharding.materialize(module, self.root_device)
        self._modules.add(module)
        return module
