"""Fabric: the facade. It holds the parts the connector resolved and forwards to them; it never
talks to torch.distributed itself."""
from __future__ import annotations

import atexit
import os
import time
import warnings
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Dict, Generator, List, Mapping, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from fabriclite import collectives
from fabriclite.accelerators import Accelerator
from fabriclite.checkpoint import lineage, manifest, resume_state
from fabriclite.checkpoint.resume_state import ResumeState
from fabriclite.checkpoint.saving import load_raw
from fabriclite.compat import lightning_module, run_method, user_warnings
from fabriclite.connector import Connector, cli_used
from fabriclite.data import elastic_dealing
from fabriclite.data.sampling import gather_eval as _gather_eval
from fabriclite.loggers.base import scalars, share_logger_state
from fabriclite.strategies import Strategy
from fabriclite.supervision.rank import progress as rank_progress
from fabriclite.supervision.rank import signals as rank_signals
from fabriclite.supervision.watch import events
from fabriclite.supervision.agent.output_forwarding import line_buffer_stdio
from fabriclite.supervision.rank.child import ERROR_FILE_ENV, exit_on_error, record_errors
from fabriclite.supervision.agent.restarts import agree_restart_count, restart_count
from fabriclite.training import live_recovery, module_setup, wrapping
from fabriclite.training.callbacks import as_callback_list, call_hook
from fabriclite.training.seeding import seed_everything as _seed_everything
from fabriclite.training.wrapping import FabricModule, FabricOptimizer


class Fabric:
    """Turns a plain PyTorch script into a distributed one.

    Arguments follow Lightning Fabric: ``accelerator`` ("auto", "cpu", "cuda"/"gpu", "mps", "tpu"),
    ``strategy`` ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "single_device", "fsdp", "horovod",
    "xla", ... or an instance), ``devices`` ("auto", an int, a list of GPU indices, "0,1", -1),
    ``num_nodes``, ``precision``, ``plugins``, ``callbacks``, ``loggers``; ``max_restarts`` (fabriclite's own:
    start every rank again after a failure, up to N times; see fabriclite.supervision.agent.restarts). Bad values raise
    ValueError/TypeError here, before any process starts.

    In a script started by `fabriclite run` (or Lightning's `fabric run`: ``LT_CLI_USED=1``) the processes exist
    already: ``Fabric(...)`` joins the job here, and ``launch()`` is then a no-op (``launch(fn)`` runs ``fn``).
    """

    def __init__(
        self,
        *,
        accelerator: Union[str, Accelerator] = "auto",
        strategy: Union[str, Strategy] = "auto",
        devices: Union[List[int], str, int] = "auto",
        num_nodes: Optional[int] = None,
        precision: Union[str, int, None] = None,
        plugins: Optional[Any] = None,
        callbacks: Optional[Any] = None,
        loggers: Optional[Any] = None,
        max_restarts: Optional[int] = None,
    ) -> None:
        self._connector = Connector(accelerator, strategy, devices, num_nodes, precision, plugins, max_restarts)
        self._strategy: Strategy = self._connector.strategy
        self._accelerator: Accelerator = self._connector.accelerator
        self._precision = self._connector.precision
        self._callbacks = as_callback_list(callbacks)
        self._loggers = _as_list(loggers)
        self._launched = False
        self._joined_by_cli = False
        self._preempted = False
        self._lineages = lineage.Lineages()  # global rank 0: the lineage each checkpoint directory continues
        self._restart_count: Optional[int] = None
        self._bind_loggers()
        user_warnings.apply_env_switch()  # POSSIBLE_USER_WARNINGS=0 / off (Lightning reads it on import)
        cli = cli_used()
        run_method.prepare(self, Fabric, cli)
        if cli and self._strategy.launcher is None:  # the CLI started this rank: join now, as Lightning does
            self._setup_rank(register_atexit=True)
            self._joined_by_cli = True

    # ------------------------------------------------------------------ rank facts
    @property
    def accelerator(self) -> Accelerator:
        return self._accelerator

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def device(self) -> torch.device:
        """The device of this rank (before launch: the device local rank 0 will use)."""
        return self._strategy.root_device

    @property
    def world_size(self) -> int:
        return self._strategy.world_size

    @property
    def global_rank(self) -> int:
        return self._strategy.global_rank

    @property
    def local_rank(self) -> int:
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        return self._strategy.node_rank

    @property
    def num_nodes(self) -> int:
        return self._connector.num_nodes

    @property
    def is_global_zero(self) -> bool:
        return self._strategy.is_global_zero

    @property
    def restart_count(self) -> int:
        """How many times this job's training was started again after its first start, as far as fabriclite can
        know: fabriclite's rounds (``--max-restarts``) + SLURM's requeues (``SLURM_RESTART_COUNT``) + torchrun's
        restarts (``TORCHELASTIC_RESTART_COUNT``). The same on every rank: agreed at launch (the maximum over the
        ranks; torchrun's late-joining agents count from 0). Before launch, this process's own count. Ray does not
        say: restarts by Ray Train are not counted. See docs/reliability.md, "What restart_count counts"."""
        return self._restart_count if self._restart_count is not None else restart_count()

    # ------------------------------------------------------------------ launch
    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Override in a subclass with the training code: ``fabric.run(...)`` then launches the processes and
        runs it on every rank with those arguments (see fabriclite.compat.run_method)."""

    def launch(self, function: Callable[..., Any] = run_method.do_nothing, *args: Any, **kwargs: Any) -> Any:
        """Start or join the processes, then run ``function(self, *args, **kwargs)`` on every rank if
        given.

        Script mode ("ddp"): this process becomes the supervisor, re-runs the script once per local rank
        and exits with the job's code (code above ``launch()`` runs in the supervisor too); each rank
        gets its own return value. spawn/fork strategies need ``function`` and return rank 0's result.
        Under an external launcher (torchrun, srun, mpirun) nothing is started. Under `fabriclite run` (or
        Lightning's `fabric run`) the Fabric joined in ``__init__``: ``launch()`` does nothing and
        ``launch(fn, ...)`` returns ``fn(fabric, ...)`` run on this rank. TypeError for a ``function`` that is
        not a callable taking the Fabric (``launch(None)``, ``launch(train(fabric))``), before anything starts.
        """
        run_method.check_function(function)
        if function is run_method.do_nothing:
            function = None
        if self._joined_by_cli:
            return function(self, *args, **kwargs) if function is not None else None
        if self._launched:
            raise RuntimeError("launch() was already called on this Fabric; call it once per process.")
        launcher = self._strategy.launcher
        if launcher is None:
            self._setup_rank(register_atexit=True)
            return function(self, *args, **kwargs) if function is not None else None
        from fabriclite.launchers import SubprocessScriptLauncher

        if isinstance(launcher, SubprocessScriptLauncher):
            launcher.max_restarts = self._connector.max_restarts
            return launcher.launch(function)  # the supervisor exits with the job's code
        if function is None:
            raise TypeError(f"strategy={self._strategy.name!r} with start method "
                            f"{getattr(self._strategy, 'start_method', '?')!r} runs a function in new processes: "
                            "call fabric.launch(fn) with fn(fabric, ...).")
        return launcher.launch(self._run_on_rank, function, *args, **kwargs)

    def _run_on_rank(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs in a spawned/forked rank: join the job, run ``function``, leave."""
        from fabriclite.environments import FabricliteEnvironment

        self._strategy.cluster_environment = FabricliteEnvironment()
        self._setup_rank(register_atexit=False)
        try:
            return function(self, *args, **kwargs)
        finally:
            self._teardown()

    def _setup_rank(self, register_atexit: bool) -> None:
        if ERROR_FILE_ENV in os.environ:
            record_errors()
        if self.world_size > 1:
            line_buffer_stdio()  # one write per printed line: ranks sharing a terminal or pipe never glue lines
        rank_signals.install(self._strategy.global_rank, self._strategy.cluster_environment)
        self._strategy.setup_environment()
        self._launched = True
        self._restart_count = agree_restart_count(self._strategy)
        self._bind_loggers()
        if self.world_size > 1:
            share_logger_state(self._loggers, self.global_rank,
                               lambda obj: collectives.broadcast(self._strategy, obj, 0))
        if register_atexit:  # an error there (an asynchronous save that failed) must not leave exit code 0
            atexit.register(exit_on_error, self._teardown)

    def _teardown(self) -> None:
        for logger in self._loggers:
            finalize = getattr(logger, "finalize", None)
            if finalize is not None:
                finalize("success")
        self._strategy.teardown()

    def _check_launched(self, what: str) -> None:
        """RuntimeError before the job is joined (several processes, no ``launch()`` yet), before anything
        reaches torch.distributed (Lightning's rule: every strategy but the single-device one)."""
        if not self._launched and not self._strategy.single_device:
            raise RuntimeError(f"fabric.{what}() with strategy={self._strategy.name!r} needs this process to join the "
                               "job: call fabric.launch() first (under torchrun / srun / mpirun too), or start the "
                               "script with `fabriclite run`.")

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: Optional[str] = None, check: bool = True) -> None:
        """Wait until every rank reaches this point (see fabriclite.collectives.barrier)."""
        self._check_launched("barrier")
        collectives.barrier(self._strategy, name, check=check)

    def broadcast(self, obj: Any, src: int = 0, check: bool = True) -> Any:
        """``obj`` from global rank ``src`` on every rank (see fabriclite.collectives.broadcast)."""
        self._check_launched("broadcast")
        return collectives.broadcast(self._strategy, obj, src, check=check)

    def all_gather(self, data: Any, group: Optional[Any] = None, sync_grads: bool = False, cat: bool = False,
                   check: bool = True) -> Any:
        """Every rank's ``data``, leaf by leaf (see fabriclite.collectives.all_gather)."""
        self._check_launched("all_gather")
        return collectives.all_gather(self._strategy, data, group=group, sync_grads=sync_grads, cat=cat, check=check)

    def all_reduce(self, data: Any, group: Optional[Any] = None, reduce_op: Any = "mean", check: bool = True,
                   inplace: bool = False) -> Any:
        """``data`` reduced over the ranks, leaf by leaf (see fabriclite.collectives.all_reduce)."""
        self._check_launched("all_reduce")
        return collectives.all_reduce(self._strategy, data, group=group, reduce_op=reduce_op, check=check,
                                      inplace=inplace)

    def gather(self, data: Any, dst: int = 0, group: Optional[Any] = None) -> Any:
        """A list of every rank's ``data`` on rank ``dst``; None elsewhere."""
        self._check_launched("gather")
        return collectives.gather(self._strategy, data, dst=dst, group=group)

    def reduce(self, data: Any, dst: int = 0, reduce_op: Any = "mean", group: Optional[Any] = None,
               check: bool = True, inplace: bool = False) -> Any:
        """``data`` reduced over the ranks on rank ``dst``; None elsewhere (see fabriclite.collectives.reduce)."""
        self._check_launched("reduce")
        return collectives.reduce(self._strategy, data, dst=dst, reduce_op=reduce_op, group=group, check=check,
                                  inplace=inplace)

    @contextmanager
    def rank_zero_first(self, local: bool = False) -> Generator[None, None, None]:
        """Rank 0 (of each node with ``local=True``) runs the block first; the others wait, without a
        deadline, and raise rank 0's error if its block raised."""
        self._check_launched("rank_zero_first")
        with collectives.rank_zero_first(self._strategy, local=local):
            yield

    # ------------------------------------------------------------------ training set-up
    def setup(self, module: nn.Module, *optimizers: Optimizer, scheduler: Optional[Any] = None,
              move_to_device: bool = True, _reapply_compile: bool = True) -> Any:
        """The wrapped module, or ``(module, *optimizers[, scheduler])`` (see fabriclite.training.module_setup.setup_module)."""
        self._check_launched("setup")
        wrapped, opts, scheduler = module_setup.setup_module(self._strategy, module, optimizers, move_to_device,
                                                         self._callbacks, scheduler, _reapply_compile)
        lightning_module.attach(self, wrapped.module, self._callbacks, opts)
        self.call("on_after_setup", fabric=self, module=wrapped)
        if not opts:
            return wrapped
        return (wrapped, *opts, scheduler) if scheduler is not None else (wrapped, *opts)

    def setup_module(self, module: nn.Module, move_to_device: bool = True,
                     _reapply_compile: bool = True) -> FabricModule:
        """``module`` wrapped for the strategy and precision, without optimizers."""
        self._check_launched("setup_module")
        wrapped, _, _ = module_setup.setup_module(self._strategy, module, (), move_to_device, self._callbacks,
                                              reapply_compile=_reapply_compile)
        lightning_module.attach(self, wrapped.module, self._callbacks)
        self.call("on_after_setup", fabric=self, module=wrapped)
        return wrapped

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        """The wrapped optimizer, or a tuple of them for several."""
        self._check_launched("setup_optimizers")
        wrapped = module_setup.setup_optimizers(self._strategy, optimizers, self._callbacks)
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def setup_dataloaders(self, *dataloaders: DataLoader, use_distributed_sampler: bool = True,
                          move_to_device: bool = True) -> Any:
        """Each loader sharded across ranks and moving batches to the device (see fabriclite.data.sampling)."""
        self._check_launched("setup_dataloaders")
        if not dataloaders:
            raise ValueError("setup_dataloaders() needs at least one DataLoader.")
        out = [module_setup.setup_dataloader(dl, self._strategy, use_distributed_sampler, move_to_device)
               for dl in dataloaders]
        return out[0] if len(out) == 1 else out

    # ------------------------------------------------------------------ training steps
    def backward(self, tensor: Tensor, *args: Any, model: Optional[FabricModule] = None, **kwargs: Any) -> None:
        """``tensor.backward(*args, **kwargs)`` through the strategy and precision (loss scaling)."""
        module = model._forward_module if isinstance(model, FabricModule) else model
        with rank_progress.waiting():  # backward waits for the gradient all-reduce: not busy time (stragglers)
            self._strategy.backward(tensor, module, *args, **kwargs)

    def clip_gradients(self, module: Union[nn.Module, FabricModule], optimizer: Union[Optimizer, FabricOptimizer],
                       clip_val: Optional[float] = None, max_norm: Optional[float] = None,
                       norm_type: float = 2.0, error_if_nonfinite: bool = True) -> Optional[Tensor]:
        """Clip by value (``clip_val``) or total norm (``max_norm``, returns the norm before clipping)."""
        if (clip_val is None) == (max_norm is None):
            raise ValueError(f"clip_gradients(clip_val={clip_val!r}, max_norm={max_norm!r}): give exactly one of "
                             "clip_val (clip each gradient value) or max_norm (clip the total norm).")
        module, optimizer = wrapping.unwrap(module), wrapping.unwrap(optimizer)
        if clip_val is not None:
            self._strategy.clip_gradients_value(module, optimizer, clip_val=clip_val)
            return None
        return self._strategy.clip_gradients_norm(module, optimizer, max_norm=max_norm, norm_type=norm_type,
                                                  error_if_nonfinite=error_if_nonfinite)

    def autocast(self) -> ContextManager:
        """The precision's forward context (autocast for mixed precision) for code outside the model."""
        return self._precision.forward_context()

    def no_backward_sync(self, module: FabricModule, enabled: bool = True) -> ContextManager:
        """Skip gradient synchronisation for forward+backward inside the block (gradient accumulation)."""
        if not isinstance(wrapping._unwrap_compiled(module), FabricModule):
            raise TypeError("no_backward_sync(module) needs the module returned by fabric.setup(); got "
                            f"{type(module).__name__}. Call `model = fabric.setup(model, ...)` first.")
        return self._strategy.no_backward_sync(wrapping.unwrap(module), enabled)

    def to_device(self, obj: Any) -> Any:
        """A module moved to this rank's device (in place), or a (nested) collection of tensors copied there."""
        if isinstance(obj, nn.Module):
            return self._strategy.module_to_device(obj)
        return self._strategy.batch_to_device(obj)

    def init_module(self, empty_init: Optional[bool] = None) -> ContextManager:
        """Build modules on the device, in the precision's dtype (skip initialisers with ``empty_init``)."""
        self._check_launched("init_module")
        return self._strategy.module_init_context(empty_init=empty_init)

    def sharded_model(self) -> ContextManager:
        """Deprecated (Lightning too): warns, and returns the strategy's module-sharding context where it has one,
        else a null context. Use ``init_module()``."""
        if self.is_global_zero:
            warnings.warn("`Fabric.sharded_model()` is deprecated in favor of `Fabric.init_module()`.",
                          DeprecationWarning, stacklevel=2)
        self._check_launched("sharded_model")
        context = getattr(self._strategy, "module_sharded_context", None)
        return context() if context is not None else nullcontext()

    def init_tensor(self) -> ContextManager:
        """Create tensors on the device, in the precision's dtype."""
        return self._strategy.tensor_init_context()

    @staticmethod
    def seed_everything(seed: Optional[int] = None, workers: Optional[bool] = None, verbose: bool = True) -> int:
        """Seed python / numpy / torch and the DataLoader workers (see fabriclite.training.seeding.seed_everything)."""
        return _seed_everything(seed, workers=True if workers is None else workers, verbose=verbose)

    def progress_bar(self, iterable: Optional[Any] = None, **kwargs: Any) -> Any:
        """A tqdm bar on global rank 0, a silent pass-through elsewhere (see fabriclite.training.progress_bar)."""
        from fabriclite.training.progress_bar import progress_bar

        return progress_bar(iterable, enabled=self.is_global_zero, **kwargs)

    def gather_eval(self, data: Any, dataloader: Any) -> Any:
        """Per-sample results of one eval pass from every rank, each sample once (see fabriclite.data.sampling)."""
        self._check_launched("gather_eval")
        return _gather_eval(self._strategy, data, wrapping.unwrap(dataloader))

    # ------------------------------------------------------------------ checkpoints and preemption
    def save(self, path: Union[str, "os.PathLike[str]"], state: Dict[str, Any],
             filter: Optional[Dict[str, Callable[[str, Any], bool]]] = None, *, keep: Optional[int] = None) -> None:
        """Write ``state`` to ``path`` through the strategy (global rank 0 and its CheckpointIO, atomic by default;
        every rank its shard for sharded strategies); every rank returns when it is written (asynchronous saves:
        snapshotted). ``keep=K``: record it in the directory's manifest once complete and keep the K newest of its
        lineage, which a resumed run continues (see fabriclite.checkpoint.manifest and .lineage)."""
        self._check_launched("save")
        started = time.perf_counter()
        unwrapped = wrapping.unwrap(state, loaders=False)
        if keep is None:
            self._strategy.save_checkpoint(path, unwrapped, filter=filter)
        else:
            manifest.save_recorded(self._strategy, path, unwrapped, filter, keep, self._lineages)
        record = rank_progress.progress()
        events.checkpoint_saved(self.global_rank, path, started, record.steps if record is not None else None)

    def load(self, path: Union[str, "os.PathLike[str]"], state: Optional[Dict[str, Any]] = None,
             strict: bool = True, *, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Restore ``state`` in place from ``path``; returns what was not restored (all of it without state). A
        checkpoint of another world size resumes elastically, said in one warning (fabriclite.data.elastic_dealing)."""
        self._check_launched("load")
        unwrapped = wrapping.unwrap(state, loaders=False)
        resume_state.set_strict(unwrapped, strict)
        with elastic_dealing.one_warning(self.global_rank == 0):
            remainder = self._strategy.load_checkpoint(path, unwrapped, strict=strict, weights_only=weights_only)
        if self.global_rank == 0:
            manifest.note_loaded(self._lineages, os.fspath(path))  # a later keep= save continues its lineage
        if state is not None:
            live_recovery.keep_values(state, unwrapped)
        return remainder

    def load_latest(self, directory: Union[str, "os.PathLike[str]"], state: Optional[Dict[str, Any]] = None,
                    strict: bool = True, *, weights_only: Optional[bool] = None) -> Optional[str]:
        """``load`` the newest checkpoint ``directory``'s manifest records that loads (older ones when it is damaged,
        with a warning): its path, or None (see fabriclite.checkpoint.latest). Under ``fabriclite run
        --fault-tolerant`` a live peer's state comes first (fabriclite.training.live_recovery)."""
        self._check_launched("load_latest")
        started = time.perf_counter()
        source = live_recovery.load_latest(self._strategy, directory, state, strict,
                                           lambda path: self.load(path, state, strict=strict, weights_only=weights_only))
        events.restored(self.global_rank, source, started)
        return source

    def check_preempted(self) -> bool:
        """Whether the job was told it will be stopped (SIGTERM / SIGUSR1 on any rank): a collective, one small
        all_reduce, the same answer on every rank at the same call. The first True also calls the callbacks'
        ``on_preempt(fabric)`` hook. Call it every N steps and save then (see fabriclite.supervision.rank.signals)."""
        self._check_launched("check_preempted")
        agreed = rank_signals.check(self._strategy)
        if agreed and not self._preempted:
            self._preempted = True
            self.call("on_preempt", self)
        return agreed

    @property
    def preempted(self) -> bool:
        """The last answer of ``check_preempted()`` (False before the first call)."""
        return self._preempted

    def resume_state(self) -> ResumeState:
        """``state["resume"] = fabric.resume_state()``: every rank's RNG states saved (fabriclite.checkpoint.resume_state)."""
        return ResumeState(self._strategy)

    def load_raw(self, path: Union[str, "os.PathLike[str]"], obj: Union[nn.Module, Optimizer], strict: bool = True,
                 *, weights_only: Optional[bool] = None) -> None:
        """Load a bare state_dict file (made without Fabric) into a module or optimizer."""
        self._check_launched("load_raw")
        load_raw(self._strategy, path, wrapping.unwrap(obj), strict=strict, weights_only=weights_only)

    # ------------------------------------------------------------------ callbacks and loggers
    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call ``hook_name`` on every callback that has it (see fabriclite.training.callbacks.call_hook)."""
        call_hook(self._callbacks, hook_name, *args, **kwargs)

    @property
    def loggers(self) -> List[Any]:
        return self._loggers

    @property
    def logger(self) -> Any:
        """The first logger (IndexError-free: None when there is none)."""
        return self._loggers[0] if self._loggers else None

    def log(self, name: str, value: Any, step: Optional[int] = None) -> None:
        """Log one scalar to every logger, on global rank 0 only."""
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        """Log scalars (one-element tensors become numbers, in nested collections too) to every logger, on global
        rank 0 only. ValueError naming the key for a tensor of several elements (on every rank, as Lightning)."""
        metrics = scalars(metrics, convert=self.is_global_zero and bool(self._loggers))
        if not self.is_global_zero or not self._loggers:
            return
        for logger in self._loggers:
            logger.log_metrics(metrics=metrics, step=step)

    def _bind_loggers(self) -> None:
        rank = self._strategy.global_rank
        for logger in self._loggers:
            if callable(getattr(logger, "bind_rank", None)):
                logger.bind_rank(rank)

    # ------------------------------------------------------------------ printing
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on local rank 0 of each node only."""
        if self.local_rank == 0:
            print(*args, **kwargs)

    def __repr__(self) -> str:
        return (f"Fabric(accelerator={self._accelerator!r}, strategy={self._strategy.name!r}, "
                f"world_size={self.world_size}, num_nodes={self.num_nodes})")


def _as_list(value: Any) -> List[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
