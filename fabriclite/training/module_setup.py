"""The set-up flow behind ``Fabric.setup()`` / ``setup_module()`` / ``setup_optimizers()`` / ``setup_dataloaders()``:
checks the objects given (each set up once, an optimizer holding only the module's parameters), converts the module
to the precision, moves it to the device, lets the strategy wrap module and optimizers, moves the optimizers' state to
their parameters' devices; deals a loader's samples over the ranks (``data.sampling``) and seeds its workers; and
returns the wrappers of ``training.wrapping``."""
from __future__ import annotations

import copy
from functools import partial
from typing import Any, List, Optional, Sequence, Tuple

from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

from fabriclite.data import sampling
from fabriclite.strategies.base import Strategy
from fabriclite.training.seeding import global_seed, seed_workers_enabled, worker_init_fn
from fabriclite.training.wrapping import (FabricDataLoader, FabricModule, FabricOptimizer, _is_compiled,
                                          _unwrap_compiled)


def setup_module(strategy: Strategy, module: nn.Module, optimizers: Sequence[Optimizer] = (),
                 move_to_device: bool = True, callbacks: Optional[List[Any]] = None, scheduler: Optional[Any] = None,
                 reapply_compile: bool = True) -> Tuple[FabricModule, List[FabricOptimizer], Optional[Any]]:
    """``module`` converted to the precision, moved to the device (``move_to_device``), wrapped by the
    strategy; ``optimizers`` wrapped, their state moved to the parameters' device; ``scheduler`` passed through.

    A ``torch.compile``d module (with ``reapply_compile``, Lightning's ``_reapply_compile``): the module inside is
    set up (the strategy wraps the original, e.g. DDP) and the result compiled again with the same compiler
    context (backend, mode, options); ``FabricModule.module`` and its ``state_dict()`` are the uncompiled module's.

    Raises ValueError for an object that was set up already, and for an optimizer holding parameters that
    are not ``module``'s (for example built from a copy of the model), saying how to fix it.
    """
    if isinstance(_unwrap_compiled(module), FabricModule):
        raise ValueError("This module was set up already; pass each module to setup()/setup_module() once.")
    if not isinstance(module, nn.Module):
        raise TypeError(f"setup() expects a torch.nn.Module first; got {type(module).__name__}.")
    compiled = module if reapply_compile and _is_compiled(module) else None
    if compiled is not None:
        module = compiled._orig_mod
    for optimizer in optimizers:
        if isinstance(optimizer, FabricOptimizer):
            raise ValueError("This optimizer was set up already; pass each optimizer to setup() once.")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"setup(module, *optimizers): {type(optimizer).__name__} is not a torch.optim.Optimizer.")
    _check_optimizer_params(module, optimizers)
    original = module
    module = strategy.precision.convert_module(module)
    if move_to_device:
        module = strategy.module_to_device(module)
    forward_module, optimizers, scheduler = strategy.setup_module_and_optimizers(module, list(optimizers),
                                                                                 scheduler)
    for optimizer in optimizers:
        move_optimizer_state(optimizer)
    if compiled is not None:
        forward_module = compiled.dynamo_ctx(forward_module)  # torch.compile's own context, applied again
    wrapped = FabricModule(forward_module, strategy, original_module=original)
    return wrapped, [FabricOptimizer(opt, strategy, callbacks) for opt in optimizers], scheduler


def setup_optimizers(strategy: Strategy, optimizers: Sequence[Optimizer],
                     callbacks: Optional[List[Any]] = None) -> List[FabricOptimizer]:
    """``optimizers`` (built from an already set-up module's parameters) wrapped for the strategy."""
    if not optimizers:
        raise ValueError("setup_optimizers() needs at least one optimizer.")
    out = []
    for optimizer in optimizers:
        if isinstance(optimizer, FabricOptimizer):
            raise ValueError("This optimizer was set up already; pass each optimizer once.")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"setup_optimizers(): {type(optimizer).__name__} is not a torch.optim.Optimizer.")
        optimizer = strategy.setup_optimizer(optimizer)
        move_optimizer_state(optimizer)
        out.append(FabricOptimizer(optimizer, strategy, callbacks))
    return out


def setup_dataloader(dataloader: DataLoader, strategy: Strategy, use_distributed_sampler: bool = True,
                     move_to_device: bool = True) -> FabricDataLoader:
    """``dataloader`` prepared for this rank: a copy whose samples are dealt over the ranks (``data.sampling``; an
    ``IterableDataset`` is left alone, as with ``use_distributed_sampler=False``), its workers seeded per rank when
    ``seed_everything(..., workers=True)`` was called; the original is not modified.

    Iterating the result moves every batch (nested tensors) to the strategy's device when
    ``move_to_device``, and calls ``set_epoch`` on the sampler for each new epoch.
    """
    if isinstance(dataloader, FabricDataLoader):
        raise ValueError("This dataloader was set up already; pass each loader to setup_dataloaders() once.")
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"setup_dataloaders() takes torch.utils.data.DataLoader objects; got "
                        f"{type(dataloader).__name__}.")
    loader = copy.copy(dataloader)
    loader._iterator = None  # type: ignore[attr-defined] # do not share persistent workers with the original
    kwargs = strategy.distributed_sampler_kwargs
    if use_distributed_sampler and kwargs is not None and not isinstance(loader.dataset, IterableDataset):
        sampling.shard(loader, kwargs, global_seed())
    if seed_workers_enabled() and loader.worker_init_fn is None and loader.num_workers > 0:
        loader.worker_init_fn = partial(worker_init_fn, rank=strategy.global_rank)
    loader = strategy.process_dataloader(loader)
    return FabricDataLoader(loader, strategy, strategy.root_device if move_to_device else None)


def move_optimizer_state(optimizer: Optimizer) -> None:
    """Every tensor in ``optimizer``'s state moved to its parameter's device (scalar ``step`` counters,
    which optimizers keep on the CPU, stay where they are)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if isinstance(value, Tensor) and key != "step" and value.device != param.device:
                    state[key] = value.to(param.device)


def _check_optimizer_params(module: nn.Module, optimizers: Sequence[Optimizer]) -> None:
    own = {id(p) for p in module.parameters()}
    for index, optimizer in enumerate(optimizers):
        foreign = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in own]
        if foreign:
            total = sum(len(group["params"]) for group in optimizer.param_groups)
            raise ValueError(
                f"optimizer {index} ({type(optimizer).__name__}) holds {len(foreign)} of its {total} parameters that "
                f"are not parameters of the {type(module).__name__} passed to setup() (was the optimizer built "
                "from another copy of the model, e.g. before a deepcopy or a move?). Build the optimizer from this "
                "module's parameters: `optimizer = Opt(model.parameters())` and then `fabric.setup(model, "
                "optimizer)`; or `model = fabric.setup_module(model)` first and then "
                "`fabric.setup_optimizers(Opt(model.parameters()))`.")
