"""Callbacks: plain objects whose methods are hooks, called by name through ``fabric.call(hook_name, ...)``.

Hooks fabriclite itself calls (as Lightning Fabric does):

- ``on_after_setup(fabric, module)`` after ``fabric.setup(...)`` / ``setup_module(...)``;
- ``on_after_optimizer_step(strategy, optimizer)`` after every step of a set-up optimizer.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional


def call_hook(callbacks: Iterable[Any], hook_name: str, *args: Any, **kwargs: Any) -> None:
    """Call ``hook_name(*args, **kwargs)`` on every callback that has it, in order.

    Keyword arguments a hook's signature does not take are left out for that hook (unless it takes
    ``**kwargs``), so callbacks may implement a hook with fewer parameters. A non-callable attribute of
    that name is skipped with a warning. An exception in a hook propagates (later callbacks do not run).
    """
    for callback in callbacks:
        method = getattr(callback, hook_name, None)
        if method is None:
            continue
        if not callable(method):
            warnings.warn(f"Skipping callback {type(callback).__name__}.{hook_name}: it is not callable.",
                          stacklevel=2)
            continue
        method(*args, **_accepted_kwargs(method, kwargs))


def as_callback_list(callbacks: Optional[Any]) -> List[Any]:
    """``Fabric(callbacks=...)``: None, one object, or a list/tuple of objects -> a list."""
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


def _accepted_kwargs(method: Callable[..., Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    if not kwargs:
        return kwargs
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}
