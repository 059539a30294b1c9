"""The wrappers ``Fabric.setup()`` / ``setup_dataloaders()`` return (the set-up flow that makes them:
``training.module_setup``).

- ``FabricModule``: an ``nn.Module`` whose ``forward`` runs the strategy's module (DDP, ...) under the
  precision plugin (inputs converted, autocast, outputs converted back). Attribute access and method calls
  go to the original module; ``.module`` gives it back; ``state_dict()`` has the original's keys (no
  ``"module."`` prefix).
- ``FabricOptimizer``: steps through ``strategy.optimizer_step`` (gradient scaling etc.), supports
  ``step(closure)``; ``isinstance(wrapped, type(original))`` holds.
- ``FabricDataLoader``: iterates the loader with the batches moved to the device and calls the sampler's
  ``set_epoch`` once per new epoch (each ``iter()``); its position (epoch, and batch inside the epoch) is
  saved / restored with ``state_dict()`` so a resumed run continues with the next batch (``data.epoch_position``;
  a stream's: ``data.streams``).
"""
from __future__ import annotations

import inspect
from types import MethodType
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Set, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from fabriclite.data import elastic_dealing, epoch_position, streams
from fabriclite.training import forward_methods
from fabriclite.training.callbacks import call_hook
from fabriclite.strategies.base import Strategy
from fabriclite.supervision.rank import progress as rank_progress

#: LightningModule-style step methods that go through the strategy's forward (like ``forward``)
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


class FabricModule(nn.Module):
    """Runs ``forward_module`` (the strategy's wrapper, e.g. DDP) under the precision plugin and forwards
    everything else to ``original_module``."""

    def __init__(self, forward_module: nn.Module, strategy: Strategy,
                 original_module: Optional[nn.Module] = None) -> None:
        super().__init__()
        self._forward_module = forward_module
        self._original_module = forward_module if original_module is None else original_module
        self._strategy = strategy
        self._forward_methods: Set[str] = set(STEP_METHODS)
        self._fabric_module_initialized = True

    @property
    def module(self) -> nn.Module:
        """The module that was passed to ``setup()``."""
        return self._original_module

    @property
    def device(self) -> torch.device:
        """The device of the first parameter (the strategy's device when there is none)."""
        for param in self._original_module.parameters():
            return param.device
        return self._strategy.root_device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's output, with float inputs cast for ``*-true`` precisions and the forward run under
        autocast for ``*-mixed`` ones; float outputs of mixed precision come back in the default dtype."""
        precision = self._strategy.precision
        args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            output = self._forward_module(*args, **kwargs)
        output = precision.convert_output(output)
        if precision.requires_fabric_backward:
            _apply_to_tensors(output, precision.guard_backward)
        return output

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, **kwargs: Any) -> Any:
        return self._original_module.load_state_dict(state_dict, strict=strict, **kwargs)

    def mark_forward_method(self, method: Union[MethodType, str]) -> None:
        """Route calls of the original module's ``method`` through the strategy's forward (so DDP syncs
        the gradients of what it computes), like ``forward`` and the LightningModule step methods."""
        if not isinstance(method, (MethodType, str)):
            raise TypeError(f"mark_forward_method({method!r}): expected a method or its name.")
        name = method if isinstance(method, str) else method.__name__
        if name == "forward":
            raise ValueError("forward is already the forward method; mark other methods only.")
        if not isinstance(getattr(self._original_module, name, None), MethodType):
            raise AttributeError(f"mark_forward_method({name!r}): {type(self._original_module).__name__}.{name} "
                                 "does not exist or is not a method.")
        self._forward_methods.add(name)

    def __getattr__(self, item: str) -> Any:
        if item in ("_forward_methods", "_forward_module", "_original_module"):
            return super().__getattr__(item)
        wrapped = self._forward_module is not self._original_module
        if item in self._forward_methods and wrapped and hasattr(self._original_module, item):
            return forward_methods.through_forward(self._original_module, item, self.forward)
        try:
            return super().__getattr__(item)
        except AttributeError:
            attr = getattr(self._original_module, item)
            return forward_methods.refuse_bypass(self._original_module, attr, item) \
                if wrapped and inspect.ismethod(attr) else attr

    def __setattr__(self, name: str, value: Any) -> None:
        if not getattr(self, "_fabric_module_initialized", False):
            super().__setattr__(name, value)
            return
        original = self._original_module
        own = name in dir(self)
        if hasattr(original, name) or not own:
            setattr(original, name, value)
        if own:
            super().__setattr__(name, value)

    def __repr__(self) -> str:
        return f"FabricModule({self._original_module!r})"


class FabricOptimizer:
    """Steps ``optimizer`` through ``strategy.optimizer_step``; every other attribute is the optimizer's.

    ``isinstance(wrapped, type(optimizer))`` is True. After each step, callbacks with an
    ``on_after_optimizer_step(strategy, optimizer)`` hook are called.
    """

    def __init__(self, optimizer: Optimizer, strategy: Strategy, callbacks: Optional[List[Any]] = None) -> None:
        self._optimizer = optimizer
        self._strategy = strategy
        self._callbacks = callbacks if callbacks is not None else []
        # imitate the wrapped class so that isinstance checks (and its methods) work
        self.__class__ = type("Fabric" + type(optimizer).__name__, (FabricOptimizer, type(optimizer)), {})

    @property
    def optimizer(self) -> Optimizer:
        """The optimizer that was passed to ``setup()``."""
        return self._optimizer

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One optimizer step through the precision plugin; returns what the optimizer's step returns
        (the closure's loss when a closure is given)."""
        kwargs = {"closure": closure} if closure is not None else {}
        # the supervisor's view: steps (hangs, goodput) and busy time (stragglers); --fault-tolerant's step waits
        with rank_progress.waiting(getattr(self._strategy, "waits_in_optimizer", False)):
            output = self._strategy.optimizer_step(self._optimizer, **kwargs)
        record = rank_progress.progress()
        if record is not None and output is not False:  # False: --fault-tolerant's quorum did not commit it
            record.step_done()
        if self._callbacks:
            call_hook(self._callbacks, "on_after_optimizer_step", strategy=self._strategy, optimizer=self._optimizer)
        return output

    def zero_grad(self, *args: Any, **kwargs: Any) -> Any:
        """The optimizer's ``zero_grad`` with exactly the arguments given (its own defaults otherwise)."""
        # --fault-tolerant: zero_grad starts the step's quorum, a wait on the other groups
        with rank_progress.waiting(getattr(self._strategy, "waits_in_optimizer", False)):
            return self._optimizer.zero_grad(*args, **kwargs)

    def state_dict(self) -> Dict[str, Any]:
        return self._strategy.get_optimizer_state(self._optimizer)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def __getattr__(self, item: str) -> Any:
        return getattr(self._optimizer, item)

    def __repr__(self) -> str:
        return f"FabricOptimizer({self._optimizer!r})"


class FabricDataLoader:
    """Iterates ``dataloader`` with every batch moved to ``device`` (None: left where it is); each new
    ``iter()`` is a new epoch and sets the sampler's epoch first. Other attributes are the loader's."""

    def __init__(self, dataloader: DataLoader, strategy: Strategy, device: Optional[torch.device] = None) -> None:
        self._dataloader = dataloader
        self._strategy = strategy
        self._device = device
        self._num_iter_calls = 0
        self._consumed: Optional[int] = None  # batches yielded in the running epoch
        self._skip = 0  # batches a loaded mid-epoch state still has to skip
        self._dealing: Optional[Dict[str, Any]] = None  # the next epoch deals its rest after a start (elastic)
        self._running: Optional[Dict[str, Any]] = None  # the running epoch's dealing
        self._running_length: Optional[int] = None  # the running epoch's batches
        self._streams = streams.Streams(dataloader, strategy)  # a stream's position (IterableDataset, torchdata)

    @property
    def device(self) -> Optional[torch.device]:
        return self._device

    @property
    def dataloader(self) -> DataLoader:
        """The (possibly re-created) loader being iterated."""
        return self._dataloader

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` starts (0 first)."""
        return self._num_iter_calls

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` start epoch ``epoch`` (shuffling order and all) at its first batch."""
        self._num_iter_calls, self._skip, self._dealing = int(epoch), 0, None
        self._streams.forget()

    def ignore_stream_position(self) -> None:
        """Opt out for a stream whose position does not matter (an endless random stream, say): a loaded position
        inside an epoch keeps the epoch counter and the stream starts over, at any world size or number of workers,
        instead of a replay or a ``StreamPositionError``."""
        self._streams.ignore = True

    def state_dict(self) -> Dict[str, Any]:
        """``{"epoch": e, "batch": k, "world_size": w, "batch_size": b, "dataset_length": n, ...}``: inside an epoch,
        the running epoch and the batches it has yielded (a resumed run continues with the next batch, in the same
        order); between epochs, the next one and 0; the sizes the position holds for; for a loader dealt by a plain
        DistributedSampler also its ``seed``, ``shuffle`` and the samples of the epoch's order the job consumed
        (``start``, ``samples``), which let a run at another world size continue the epoch
        (``fabriclite.data.epoch_position``, ``fabriclite.data.elastic_dealing``). For a stream (an
        IterableDataset, or a torchdata StatefulDataLoader) also ``num_workers``, its kind and, inside an epoch, every
        rank's per-worker states (``fabriclite.data.streams``): then a collective, called on every rank
        (``fabric.save`` does)."""
        running = self._consumed is not None
        state = epoch_position.position(self._num_iter_calls, self._consumed, self._skip,
                                        self._running_length if running else None,
                                        epoch_position.loader_shape(self._dataloader),
                                        self._running if running else self._dealing)
        return self._streams.record(state, running)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Make the next ``iter()`` resume at ``state`` (an old ``{"epoch": n}`` starts epoch n at batch 0). A position
        inside an epoch saved at another world size continues that epoch with the samples its order has left, dealt
        over this loader's ranks, and says so in one warning (global rank 0); saved with another batch size per rank
        or dataset length it is a ValueError naming both (``fabriclite.data.epoch_position``). A stream's
        position that cannot be carried to this run's world size or number of workers is a ``StreamPositionError``
        (``fabriclite.data.stream_kinds``)."""
        self._streams.forget()
        if isinstance(state, Mapping) and ("stream" in state or "torchdata" in state) and int(state.get("batch", 0)):
            skip = self._streams.load(dict(state))
            if skip is not None:
                self._num_iter_calls, self._skip, self._consumed, self._dealing = int(state["epoch"]), skip, None, None
                return
        where = epoch_position.read_position(state, epoch_position.loader_shape(self._dataloader))
        self._num_iter_calls, self._skip, self._consumed = where["epoch"], where["batch"], None
        self._dealing = where["dealing"]
        if where["from_world_size"] is not None:
            note = epoch_position.elastic_note(self._dataloader, where["epoch"], where["dealing"],
                                               where["from_world_size"])
            elastic_dealing.note(note, self._strategy.global_rank == 0)
        elif "torchdata" in state and where["batch"] and where["dealing"] is None:  # StatefulDataLoader, same size
            self._streams.resume_torchdata(state["torchdata"], where["batch"])
            self._skip = 0

    def __len__(self) -> int:
        return len(self._dataloader)

    def __iter__(self) -> Iterator[Any]:
        set_sampler_epoch(self._dataloader, self._num_iter_calls)
        epoch = self._num_iter_calls
        self._num_iter_calls += 1
        skip, self._skip = self._skip, 0
        dealing, self._dealing = self._dealing, None
        loader = self._dataloader if dealing is None else epoch_position.rest_loader(self._dataloader, epoch, dealing)
        self._running, self._running_length = dealing, _length(loader)
        self._consumed = skip or self._streams.resumed_batches()
        to_device, device = self._strategy.batch_to_device, self._device
        self._streams.start_library(epoch)  # litdata / Streaming: the library's own epoch and position
        torchdata_state = self._streams.pending_torchdata()
        if torchdata_state is not None:
            self._dataloader.load_state_dict(torchdata_state)  # type: ignore[attr-defined]
        if self._streams.tagged:
            batches = self._streams.batches()
        else:
            batches = epoch_position.iterate_from(loader, skip, resumed=dealing is not None)
        for batch in batches:
            self._consumed = (self._consumed or 0) + 1
            yield batch if device is None else to_device(batch, device)
        self._consumed = None

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") or item == "_dataloader":
            raise AttributeError(item)
        return getattr(self._dataloader, item)

    def __repr__(self) -> str:
        return f"FabricDataLoader({self._dataloader!r}, device={self._device})"


# Lightning Fabric's names for the same classes
_FabricModule = FabricModule
_FabricOptimizer = FabricOptimizer
_FabricDataLoader = FabricDataLoader


def is_wrapped(obj: object) -> bool:
    """Whether ``obj`` was returned by ``setup()`` / ``setup_module()`` / ``setup_optimizers()`` /
    ``setup_dataloaders()``."""
    return isinstance(_unwrap_compiled(obj), (FabricModule, FabricOptimizer, FabricDataLoader))


def unwrap(obj: Any, loaders: bool = True) -> Any:
    """The object under a wrapper: a FabricModule's strategy module (e.g. the DDP wrapper), a
    FabricOptimizer's optimizer, a FabricDataLoader's loader (kept wrapped with ``loaders=False``: it is
    stateful); a dict / list / tuple is unwrapped item by item; anything else is returned unchanged."""
    if isinstance(obj, dict):
        return {k: unwrap(v, loaders) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(unwrap(v, loaders) for v in obj)
    obj = _unwrap_compiled(obj)
    if isinstance(obj, FabricModule):
        return _unwrap_compiled(obj._forward_module)
    if isinstance(obj, FabricOptimizer):
        return obj.optimizer
    if isinstance(obj, FabricDataLoader) and loaders:
        return obj.dataloader
    return obj


def _apply_to_tensors(data: Any, fn: Callable[[Tensor], None]) -> None:
    if isinstance(data, Tensor):
        fn(data)
    elif isinstance(data, Mapping):
        for value in data.values():
            _apply_to_tensors(value, fn)
    elif isinstance(data, (list, tuple)):
        for value in data:
            _apply_to_tensors(value, fn)


def _is_compiled(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.compile``d module (an ``OptimizedModule``; torch._dynamo is not imported)."""
    return type(obj).__name__ == "OptimizedModule" and getattr(obj, "_orig_mod", None) is not None


def _unwrap_compiled(obj: Any) -> Any:
    return obj._orig_mod if _is_compiled(obj) else obj


def set_sampler_epoch(dataloader: DataLoader, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on the loader's sampler and batch sampler's sampler, where they have one."""
    seen = set()
    for obj in (getattr(dataloader, "sampler", None), getattr(dataloader, "batch_sampler", None),
                getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)):
        if obj is not None and id(obj) not in seen and callable(getattr(obj, "set_epoch", None)):
            seen.add(id(obj))
            obj.set_epoch(epoch)


def _length(loader: DataLoader) -> Optional[int]:
    try:
        return len(loader)
    except TypeError:
        return None
