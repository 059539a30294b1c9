"""The XLA launcher: torch_xla's ``xmp.spawn`` starts one replica per XLA device (a process per TPU chip; on XLA's
CPU devices one process with a thread per device) and the caller gets global rank 0's return value."""
from __future__ import annotations

import copy
import os
import pickle
import tempfile
from typing import Any, Callable, Dict, Tuple

from fabriclite.launchers.base import Launcher


class XLALauncher(Launcher):
    """Runs ``function(*args, **kwargs)`` on every XLA device of this host through ``xmp.spawn`` (fork start method,
    so it works from a notebook too; the parent must not have touched an XLA device before).

    Returns what global rank 0's call returned (tensors moved to the CPU; it must pickle). An exception in any
    replica propagates out of ``launch``. Where one process drives several devices, each thread gets its own deep
    copy of ``function``/``args`` (and so of the Fabric), as the replicas must not share state.
    """

    is_interactive_compatible = True

    def __init__(self, strategy: Any, start_method: str = "fork") -> None:
        self.strategy = strategy
        self.start_method = start_method

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import torch_xla
        import torch_xla.distributed.xla_multiprocessing as xmp

        if torch_xla._XLAC._xla_runtime_is_initialized():
            raise RuntimeError("The XLA runtime is already initialised in this process (an XLA device was used "
                               "before fabric.launch()); create XLA tensors only inside the launched function.")
        nprocs = 1 if self.strategy.num_processes == 1 else None  # xmp.spawn takes 1 or "all devices"
        with tempfile.TemporaryDirectory(prefix="fabriclite-xla-") as tmp:
            result_path = os.path.join(tmp, "result.pkl")
            xmp.spawn(_replica, args=(result_path, function, args, kwargs), nprocs=nprocs,
                      start_method=self.start_method)
            if not os.path.exists(result_path):
                return None
            with open(result_path, "rb") as f:
                return pickle.load(f)


def _replica(index: int, result_path: str, function: Callable[..., Any], args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> None:
    from torch_xla import runtime as xr

    if xr.addressable_device_count() > 1:  # several replicas (threads) in this process: no shared objects
        function, args, kwargs = copy.deepcopy((function, args, kwargs))
    result = function(*args, **kwargs)
    if xr.global_ordinal() == 0:
        import torch
        from lightning_utilities.core.apply_func import apply_to_collection

        result = apply_to_collection(result, torch.Tensor, lambda t: t.detach().cpu())
        tmp = f"{result_path}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
        os.replace(tmp, result_path)
