"""FSDP on FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded
over the ranks, with Lightning's FSDPStrategy arguments.

FSDPStrategy is a DDPStrategy for everything about processes (the process group, its store, the collective
primitives, the launcher), so ``fabric.all_reduce`` & co. run on the same group as the sharding. What differs:
how a module is wrapped (``fully_shard`` by policy, innermost first, then the root), how the optimizer follows
the sharded parameters, gradient clipping over all shards, ``no_backward_sync`` and checkpoints (see
``fabriclite.checkpoint.dcp``).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

import torch
from torch import nn

from fabriclite.strategies import fsdp2 as sharding
from fabriclite.strategies.ddp import StartMethod
from fabriclite.strategies.sharded_base import ShardedStrategy

#: fully_shard's own keyword arguments, accepted as extra keyword arguments
FULLY_SHARD_KWARGS = ("reshard_after_forward", "shard_placement_fn", "ignored_params")
#: FSDP1 keyword arguments Lightning passes on that FSDP2 has no use for (FSDP2 always keeps the original
#: parameters, prefetches by itself and needs no device_id): accepted and ignored
FSDP1_IGNORED = ("use_orig_params", "limit_all_gathers", "forward_prefetch", "backward_prefetch",
                 "sync_module_states", "device_id", "param_init_fn")
#: accelerators FSDP2 runs on here
SUPPORTED = "cpu (gloo, 2 or more processes) or cuda (nccl)"


class FSDPStrategy(ShardedStrategy):
    """Fully sharded data parallel (FSDP2) with Lightning's FSDPStrategy arguments.

    ``auto_wrap_policy`` / ``activation_checkpointing_policy``: a set of module classes or a callable
    ``(module) -> bool`` (FSDP1's ``(module, recurse, nonwrapped_numel)`` form too); each selected submodule is
    sharded (checkpointed) on its own, then the root. ``mixed_precision``: a MixedPrecisionPolicy, Lightning's
    MixedPrecision, or None (from ``precision``: "bf16-mixed" computes in bf16 and reduces in fp32).
    ``sharding_strategy``: FULL_SHARD (1-D mesh, reshard after forward), SHARD_GRAD_OP (1-D, kept unsharded
    between forward and backward), HYBRID_SHARD (2-D nodes x devices), NO_SHARD (replicated).
    ``state_dict_type``: "sharded" (a torch.distributed.checkpoint directory + ``meta.pt``) or "full" (one file).
    ``cpu_offload`` needs cuda (FSDP2 offloads from an accelerator to the CPU). ``async_save=True`` (fabriclite's):
    ``fabric.save`` snapshots the state and returns; the checkpoint is written in the background
    (``fabriclite.checkpoint.async_save``).
    """

    name = "fsdp"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Any = None,
        precision: Any = None,
        process_group_backend: Optional[str] = None,
        timeout: Union[None, float, timedelta] = None,
        cpu_offload: Any = None,
        mixed_precision: Any = None,
        auto_wrap_policy: Any = None,
        activation_checkpointing: Any = None,
        activation_checkpointing_policy: Any = None,
        sharding_strategy: Any = "FULL_SHARD",
        state_dict_type: Literal["full", "sharded"] = "sharded",
        device_mesh: Any = None,
        start_method: StartMethod = "popen",
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        unknown = sorted(set(kwargs) - set(FULLY_SHARD_KWARGS) - set(FSDP1_IGNORED))
        if unknown:
            raise TypeError(f"FSDPStrategy got unexpected keyword arguments {unknown}; extra keyword arguments go to "
                            f"torch.distributed.fsdp.fully_shard: {list(FULLY_SHARD_KWARGS)} (FSDP1's "
                            f"{list(FSDP1_IGNORED)} are accepted and have no effect under FSDP2).")
        if activation_checkpointing is not None and activation_checkpointing_policy is not None:
            raise ValueError("Pass activation_checkpointing_policy only (activation_checkpointing is its deprecated "
                             "form); both were given.")
        self.auto_wrap_policy = sharding.as_policy(auto_wrap_policy, "auto_wrap_policy")
        self.activation_checkpointing_policy = sharding.as_policy(
            activation_checkpointing_policy if activation_checkpointing is None else activation_checkpointing,
            "activation_checkpointing_policy")
        self.sharding_strategy, self._mesh_kind, reshard = sharding.sharding_plan(sharding_strategy)
        self._fully_shard_kwargs: Dict[str, Any] = {k: v for k, v in kwargs.items() if k in FULLY_SHARD_KWARGS}
        self._fully_shard_kwargs.setdefault("reshard_after_forward", reshard)
        self._state_dict_type = sharding.check_state_dict_type(state_dict_type)
        self.cpu_offload = sharding.wants_cpu_offload(cpu_offload)
        sharding.mixed_precision_policy(mixed_precision, "32-true")  # type check now, before anything starts
        self.mixed_precision = mixed_precision
        if device_mesh is not None and not (isinstance(device_mesh, tuple) or hasattr(device_mesh, "mesh")):
            raise TypeError(f"device_mesh={device_mesh!r}: expected a (replicate, shard) tuple or a DeviceMesh.")
        self._requested_mesh = device_mesh
        self._init_sharded(async_save)

    # ------------------------------------------------------------------ configuration
    @property
    def state_dict_type(self) -> str:
        return self._state_dict_type

    @property
    def mixed_precision_config(self) -> Any:
        """FSDP2's MixedPrecisionPolicy in effect (from ``mixed_precision`` or the precision plugin)."""
        return sharding.mixed_precision_policy(self.mixed_precision, self.precision.name)

    @property
    def sharded_checkpoints(self) -> bool:  # type: ignore[override]
        return self._state_dict_type == "sharded"

    def check_configuration(self, accelerator: str, world_size: int) -> None:
        """ValueError for what FSDP2 cannot run on (called by the connector, before anything starts)."""
        if accelerator not in ("cpu", "cuda", "gpu"):
            raise ValueError(f"strategy={self.name!r} runs on {SUPPORTED}; accelerator={accelerator!r} (xla / tpu, mps) "
                             "is not supported. Use strategy='xla' for TPUs, or 'ddp'.")
        if accelerator == "cpu" and world_size < 2:
            raise ValueError(f"strategy={self.name!r} shards over processes and runs on {SUPPORTED}; a single "
                             "process shards nothing. Use devices=2 or more, or strategy='single_device'.")
        if self.cpu_offload and accelerator == "cpu":
            raise ValueError(f"cpu_offload=True (strategy={self.name!r}): FSDP2 offloads parameters from an "
                             "accelerator to the CPU, and with accelerator='cpu' they are there already. Drop "
                             "cpu_offload (or strategy='fsdp_cpu_offload'), or run on cuda.")

    def setup_environment(self) -> None:
        super().setup_environment()
        self._device_mesh = self._build_mesh()

    def _build_mesh(self) -> Any:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if isinstance(self._requested_mesh, DeviceMesh):
            return self._requested_mesh
        world, kind = self.world_size, self._mesh_kind
        shape: Tuple[int, ...]
        if isinstance(self._requested_mesh, tuple):
            shape = tuple(int(s) for s in self._requested_mesh)
        elif kind == "2d":
            shape = (self.num_nodes, world // self.num_nodes)
        elif kind == "replicate":
            shape = (world, 1)
        else:
            return init_device_mesh(self.root_device.type, (world,), mesh_dim_names=("shard",))
        if len(shape) != 2 or shape[0] * shape[1] != world:
            raise ValueError(f"device_mesh={shape}: expected (replicate, shard) whose product is the world size "
                             f"({world}).")
        return init_device_mesh(self.root_device.type, shape, mesh_dim_names=("replicate", "shard"))

    def _fully_shard_options(self) -> Dict[str, Any]:
        options = dict(self._fully_shard_kwargs)
        options["mesh"] = self.device_mesh
        options["mp_policy"] = self.mixed_precision_config
        if self.cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            options["offload_policy"] = CPUOffloadPolicy()
        return options

    # ------------------------------------------------------------------ set-up
    def setup_module(self, module: nn.Module) -> nn.Module:
        """``module`` sharded in place (activation checkpointing applied first) and materialised when it was
        built on the meta device. TypeError for a module wrapped in FSDP1."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            raise TypeError("The module holds torch.distributed.fsdp.FullyShardedDataParallel (FSDP1) wrappers; "
                            f"strategy={self.name!r} shards with FSDP2's fully_shard. Pass the plain module.")
        sharding.apply_activation_checkpointing(module, self.activation_checkpointing_policy)
        sharding.shard(module, self.auto_wrap_policy, **self._fully_shard_options())
        sharding.materialize(module, self.root_device)
        self._modules.add(module)
        return module
