"""Helpers the sharded strategies (fsdp, model_parallel) share: reading Lightning's FSDP arguments into FSDP2
terms, applying ``fully_shard`` / activation checkpointing by policy, materialising a meta-device model after
sharding, re-pointing an optimizer at the sharded parameters, and counting a rank's bytes.

Nothing here talks to a process group except through ``fully_shard`` itself.
"""
from __future__ import annotations

import inspect
import itertools
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

#: sharding_strategy -> (mesh kind, reshard_after_forward); "replicate" is a (world, 1) mesh
SHARDING = {
    "FULL_SHARD": ("1d", True),
    "SHARD_GRAD_OP": ("1d", False),
    "HYBRID_SHARD": ("2d", True),
    "NO_SHARD": ("replicate", True),
}
STATE_DICT_TYPES = ("full", "sharded")
Policy = Callable[[nn.Module], bool]


def as_policy(policy: Any, argument: str) -> Optional[Policy]:
    """``policy`` (None, a set/list/tuple of module classes, a ModuleWrapPolicy, a callable ``(module) -> bool``
    or FSDP1's ``(module, recurse, nonwrapped_numel) -> bool``) as ``(module) -> bool``; TypeError otherwise."""
    if policy is None:
        return None
    classes = getattr(policy, "_module_classes", None)  # torch.distributed.fsdp.wrap.ModuleWrapPolicy
    if classes is not None:
        policy = set(classes)
    if isinstance(policy, type) and issubclass(policy, nn.Module):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        bad = [c for c in policy if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad or not policy:
            raise TypeError(f"{argument}={policy!r}: a set of module classes must hold only nn.Module subclasses "
                            f"(got {bad or 'an empty set'}).")
        kinds = tuple(policy)
        return lambda module: isinstance(module, kinds)
    if callable(policy):
        try:
            params = inspect.signature(policy).parameters
        except (TypeError, ValueError):
            params = {}
        if "recurse" in params or "nonwrapped_numel" in params or len(params) >= 3:
            fsdp1 = policy
            return lambda module: bool(fsdp1(module=module, recurse=False,
                                             nonwrapped_numel=sum(p.numel() for p in module.parameters())))
        return lambda module: bool(policy(module))
    raise TypeError(f"{argument}={policy!r} ({type(policy).__name__}) is not valid; expected a set of module "
                    "classes (e.g. {nn.TransformerEncoderLayer}), a callable (module) -> bool, or None.")


def sharding_plan(sharding_strategy: Any) -> Tuple[str, str, bool]:
    """(name, mesh kind, reshard_after_forward) for a ShardingStrategy enum or its name; ValueError otherwise."""
    name = getattr(sharding_strategy, "name", sharding_strategy)
    key = name.upper() if isinstance(name, str) else name
    if key in ("_HYBRID_SHARD_ZERO2",):
        return key, "2d", False
    if key not in SHARDING:
        raise ValueError(f"sharding_strategy={sharding_strategy!r} is not supported; expected one of "
                         f"{sorted(SHARDING)} or a torch.distributed.fsdp.ShardingStrategy.")
    return (key, *SHARDING[key])


def check_state_dict_type(value: Any) -> str:
    if value not in STATE_DICT_TYPES:
        raise ValueError(f"state_dict_type={value!r} is not supported; expected 'sharded' (a directory with one "
                         "shard file per rank, the default) or 'full' (one file written by rank 0).")
    return value


def mixed_precision_policy(mixed_precision: Any, precision_name: str) -> Any:
    """FSDP2's MixedPrecisionPolicy for the ``mixed_precision`` argument (a MixedPrecisionPolicy, Lightning's FSDP1
    ``MixedPrecision`` (its buffer_dtype has no FSDP2 equivalent and is dropped), or None: from ``precision``,
    where "bf16-mixed" / "16-mixed" compute in bf16 / fp16 and reduce gradients in fp32)."""
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy

    if isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if isinstance(mixed_precision, MixedPrecision):
        return MixedPrecisionPolicy(param_dtype=mixed_precision.param_dtype,
                                    reduce_dtype=mixed_precision.reduce_dtype)
    if mixed_precision is not None:
        raise TypeError(f"mixed_precision={mixed_precision!r} ({type(mixed_precision).__name__}) is not valid; "
                        "expected torch.distributed.fsdp.MixedPrecisionPolicy, torch.distributed.fsdp.MixedPrecision "
                        "or None (derived from precision=).")
    if precision_name == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision_name == "16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def wants_cpu_offload(cpu_offload: Any) -> bool:
    """Whether ``cpu_offload`` (bool, FSDP1 CPUOffload, FSDP2 CPUOffloadPolicy or None) asks to offload."""
    if cpu_offload is None or isinstance(cpu_offload, bool):
        return bool(cpu_offload)
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy

    if isinstance(cpu_offload, CPUOffloadPolicy):
        return True
    if isinstance(cpu_offload, CPUOffload):
        return bool(cpu_offload.offload_params)
    raise TypeError(f"cpu_offload={cpu_offload!r} ({type(cpu_offload).__name__}) is not valid; expected a bool, "
                    "torch.distributed.fsdp.CPUOffload or torch.distributed.fsdp.CPUOffloadPolicy.")


def apply_activation_checkpointing(module: nn.Module, policy: Optional[Policy]) -> None:
    """Recompute the activations of every submodule ``policy`` selects in backward (composable checkpoint:
    state_dict keys do not change)."""
    if policy is None:
        return
    from torch.distributed._composable import checkpoint

    for sub in [m for m in module.modules() if policy(m)]:
        checkpoint(sub)


def shard(module: nn.Module, policy: Optional[Policy], **fully_shard_kwargs: Any) -> nn.Module:
    """``fully_shard`` every submodule ``policy`` selects, innermost first, then the root (in place)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if policy is not None:
        for sub in reversed([m for m in module.modules() if m is not module]):
            if policy(sub) and not isinstance(sub, FSDPModule):
                fully_shard(sub, **fully_shard_kwargs)
    if not isinstance(module, FSDPModule):
        fully_shard(module, **fully_shard_kwargs)
    return module


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def materialize(module: nn.Module, device: torch.device) -> None:
    """Give a (sharded) meta-device ``module`` real storage on ``device`` and run each submodule's
    ``reset_parameters()``. RuntimeError naming the modules without one (nothing is materialised then)."""
    if not has_meta(module):
        return
    owners = [m for m in module.modules()
              if any(t.is_meta for t in itertools.chain(m.parameters(recurse=False), m.buffers(recurse=False)))]
    missing = sorted({type(m).__name__ for m in owners if not callable(getattr(m, "reset_parameters", None))})
    if missing:
        raise RuntimeError(f"init_module(empty_init=True) built parameters on the meta device, but {missing} have no "
                           "reset_parameters() to initialise them after sharding. Define reset_parameters() on "
                           "those modules, or build the model without empty_init.")
    module.to_empty(device=device)
    for sub in owners:
        sub.reset_parameters()


def parameter_names(module: nn.Module) -> Dict[int, str]:
    """id(parameter) -> its fully-qualified name in ``module``."""
    return {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}


def check_repointable(optimizers: Iterable[Optimizer]) -> None:
    """ValueError for an optimizer that already holds state (its state would not follow the parameters)."""
    for index, optimizer in enumerate(optimizers):
        if any(optimizer.state.values()):
            raise ValueError(f"optimizer {index} ({type(optimizer).__name__}) already holds state (it has stepped), "
                             "so it cannot follow the parameters when sharding replaces them. Pass a fresh optimizer "
                             "to setup(), or load its state after setup() with fabric.load().")


def repoint(optimizers: Iterable[Optimizer], names: Dict[int, str], module: nn.Module) -> None:
    """Point each optimizer's param groups (built from ``module`` before sharding, ``names`` taken then) at the
    parameters ``module`` holds now, in the same order."""
    current = dict(module.named_parameters(remove_duplicate=False))
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [current[names[id(p)]] for p in group["params"]]
        optimizer.state.clear()


def local(tensor: Tensor) -> Tensor:
    """The rank-local part of a DTensor (the tensor itself otherwise)."""
    to_local = getattr(tensor, "to_local", None)
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else (to_local() if to_local else tensor)


def counted_bytes(module: nn.Module, optimizers: Iterable[Optimizer] = ()) -> int:
    """Bytes of this rank's storages for ``module``'s parameters and gradients and the optimizers' state tensors,
    padding included (each storage once)."""
    seen: Dict[Tuple[str, int], int] = {}

    def add(tensor: Optional[Tensor]) -> None:
        if tensor is None or not isinstance(tensor, Tensor):
            return
        storage = local(tensor).untyped_storage()
        seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()

    params: List[Tensor] = list(module.parameters())
    for p in params:
        add(p)
        add(p.grad)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor) and value.numel() > 1:
                    add(value)
    return sum(seen.values())
