"""Contexts for building modules and tensors in place: on the device, in the precision's dtype, and
optionally without running parameter initialisers (``empty_init``)."""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, ContextManager, Iterator

import torch
from torch.overrides import TorchFunctionMode

#: the in-place initialisers skipped under empty_init (``torch.nn.init.*_``)
_INIT_FUNCTIONS = frozenset(
    getattr(torch.nn.init, name) for name in dir(torch.nn.init)
    if name.endswith("_") and not name.startswith("_") and callable(getattr(torch.nn.init, name)))


class _SkipInit(TorchFunctionMode):
    """Turns ``torch.nn.init.*_`` calls into no-ops (parameters keep uninitialised memory)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" or func in _INIT_FUNCTIONS:
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **kwargs)


@contextmanager
def module_init_context(device: torch.device, dtype_context: ContextManager, empty_init: bool) -> Iterator[None]:
    """Tensors and parameters created inside are on ``device`` and follow ``dtype_context`` (the precision's
    default dtype); with ``empty_init`` the nn.init initialisers do not run."""
    with ExitStack() as stack:
        stack.enter_context(torch.device(device))
        stack.enter_context(dtype_context)
        if empty_init:
            stack.enter_context(_SkipInit())
        yield
