"""Methods of a set-up module other than ``forward`` (Lightning's rules): a marked one runs through the strategy's
wrapper (``FabricModule.mark_forward_method``; the LightningModule step methods are marked from the start), and an
unmarked one that runs the network is refused, since it bypassed the wrapper (DDP would not synchronise the
gradients of what it computed, and the ranks would diverge)."""
from __future__ import annotations

import functools
from typing import Any, Callable

from torch import nn


def through_forward(original: nn.Module, name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
    """``original.<name>`` run by ``forward`` (the wrapper's forward, e.g. DDP's): for one call, ``original.forward``
    is swapped for the method, so the wrapper's hooks see it as a forward pass."""
    original_forward = original.forward

    def redirected(*args: Any, **kwargs: Any) -> Any:
        original.forward = original_forward  # type: ignore[method-assign]
        return getattr(original, name)(*args, **kwargs)

    def call(*args: Any, **kwargs: Any) -> Any:
        original.forward = redirected  # type: ignore[method-assign]
        try:
            return forward(*args, **kwargs)
        finally:
            original.__dict__.pop("forward", None)

    return call


def refuse_bypass(original: nn.Module, method: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``method`` (``original.<name>``), checked: RuntimeError naming ``mark_forward_method`` (after it ran, as
    Lightning) when it ran ``original`` or any of its submodules; its result otherwise."""

    @functools.wraps(method)
    def checked(*args: Any, **kwargs: Any) -> Any:
        called = []
        handles = [m.register_forward_hook(lambda *_: called.append(True)) for m in original.modules()]
        try:
            output = method(*args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        if called:
            raise RuntimeError(
                f"You are calling the method `{type(original).__name__}.{name}()` from outside the model: it runs the "
                "network without the strategy's wrapper, so its gradients would not be synchronised and the ranks "
                f"would diverge. Mark it as a forward method with `model.mark_forward_method({name!r})` after "
                "`fabric.setup()`.")
        return output

    return checked
