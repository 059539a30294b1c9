"""Fabric: the facade. It holds the parts the connector resolved and forwards to them; it never
talks to torch.distributed itself."""
from __future__ import annotations

import atexit
import os
from contextlib import contextmanager
from typing import Any, Callable, Dict, Generator, List, Optional, Union

import torch

from fabriclite import collectives
from fabriclite.accelerators import Accelerator
from fabriclite.connector import Connector
from fabriclite.launchers.child import ERROR_FILE_ENV, record_errors
from fabriclite.strategies import Strategy


class Fabric:
    """Turns a plain PyTorch script into a distributed one.

    Arguments follow Lightning Fabric: ``accelerator`` ("auto", "cpu", "cuda"/"gpu", "mps", "tpu"),
    ``strategy`` ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "single_device", "horovod",
    "xla", ... or an instance), ``devices`` ("auto", an int, a list of GPU indices, "0,1", -1),
    ``num_nodes``, ``precision``, ``plugins``, ``callbacks``, ``loggers``. Bad values raise
    ValueError/TypeError here, before any process starts.
    """

    def __init__(
        self,
        accelerator: Union[str, Accelerator] = "auto",
        strategy: Union[str, Strategy] = "auto",
        devices: Union[List[int], str, int] = "auto",
        num_nodes: Optional[int] = None,
        precision: Union[str, int, None] = None,
        plugins: Optional[Any] = None,
        callbacks: Optional[Any] = None,
        loggers: Optional[Any] = None,
    ) -> None:
        self._connector = Connector(accelerator, strategy, devices, num_nodes, precision, plugins)
        self._strategy: Strategy = self._connector.strategy
        self._accelerator: Accelerator = self._connector.accelerator
        self._precision = self._connector.precision
        self._callbacks = _as_list(callbacks)
        self._loggers = _as_list(loggers)
        self._launched = False

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

    # ------------------------------------------------------------------ launch
    def launch(self, function: Optional[Callable[..., Any]] = None, *args: Any, **kwargs: Any) -> Any:
        """Start or join the processes, then run ``function(self, *args, **kwargs)`` on every rank if
        given.

        Script mode ("ddp"): this process becomes the supervisor, re-runs the script once per local rank
        and exits with the job's code (code above ``launch()`` runs in the supervisor too); each rank
        gets its own return value. spawn/fork strategies need ``function`` and return rank 0's result.
        Under an external launcher (torchrun, srun, mpirun, ``fabriclite run``) nothing is started.
        """
        if self._launched:
            raise RuntimeError("launch() was already called on this Fabric; call it once per process.")
        if function is not None and not callable(function):
            raise TypeError(f"launch(function={function!r}): expected a callable taking the Fabric as first "
                            "argument, or nothing.")
        launcher = self._strategy.launcher
        if launcher is None:
            self._setup_rank(register_atexit=True)
            return function(self, *args, **kwargs) if function is not None else None
        from fabriclite.launchers import SubprocessScriptLauncher

        if isinstance(launcher, SubprocessScriptLauncher):
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
        self._strategy.setup_environment()
        self._launched = True
        if register_atexit:
            atexit.register(self._teardown)

    def _teardown(self) -> None:
        for logger in self._loggers:
            finalize = getattr(logger, "finalize", None)
            if finalize is not None:
                finalize("success")
        self._strategy.teardown()

    # ------------------------------------------------------------------ printing and collectives
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on local rank 0 of each node only."""
        if self.local_rank == 0:
            print(*args, **kwargs)

    def barrier(self, name: Optional[str] = None) -> None:
        """Wait until every rank reaches this point."""
        collectives.barrier(self._strategy, name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from global rank ``src`` on every rank (see fabriclite.collectives.broadcast)."""
        return collectives.broadcast(self._strategy, obj, src)

    def all_gather(self, data: Any, group: Optional[Any] = None, sync_grads: bool = False, cat: bool = False) -> Any:
        """Every rank's ``data``, leaf by leaf (see fabriclite.collectives.all_gather)."""
        return collectives.all_gather(self._strategy, data, group=group, sync_grads=sync_grads, cat=cat)

    def all_reduce(self, data: Any, group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
        """``data`` reduced over the ranks, leaf by leaf (see fabriclite.collectives.all_reduce)."""
        return collectives.all_reduce(self._strategy, data, group=group, reduce_op=reduce_op)

    def gather(self, data: Any, dst: int = 0, group: Optional[Any] = None) -> Any:
        """A list of every rank's ``data`` on rank ``dst``; None elsewhere."""
        return collectives.gather(self._strategy, data, dst=dst, group=group)

    def reduce(self, data: Any, dst: int = 0, reduce_op: Any = "mean", group: Optional[Any] = None) -> Any:
        """``data`` reduced over the ranks on rank ``dst``; None elsewhere."""
        return collectives.reduce(self._strategy, data, dst=dst, reduce_op=reduce_op, group=group)

    @contextmanager
    def rank_zero_first(self, local: bool = False) -> Generator[None, None, None]:
        """Rank 0 (of each node with ``local=True``) runs the block first; the others wait, without a
        deadline, and raise rank 0's error if its block raised."""
        with collectives.rank_zero_first(self._strategy, local=local):
            yield

    def __repr__(self) -> str:
        return (f"Fabric(accelerator={self._accelerator!r}, strategy={self._strategy.name!r}, "
                f"world_size={self.world_size}, num_nodes={self.num_nodes})")


def _as_list(value: Any) -> List[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
