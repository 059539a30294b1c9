"""Precision plugins: 32-true, 64-true, 16-mixed, bf16-mixed, 16-true, bf16-true.

A plugin converts the module (``*-true``), casts floating-point inputs of a set-up module's ``forward`` to its
compute dtype (every mode but 32-true) and the outputs back to the default dtype, opens the autocast context
(``*-mixed``), and runs backward / optimizer steps (gradient scaling for 16-mixed on cuda). As Lightning's plugins.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Dict, Iterator, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

#: user-facing values and aliases -> canonical name
PRECISION_ALIASES: Dict[Any, str] = {
    "32-true": "32-true", "32": "32-true", 32: "32-true",
    "64-true": "64-true", "64": "64-true", 64: "64-true",
    "16-mixed": "16-mixed", "16": "16-mixed", 16: "16-mixed",
    "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed",
    "16-true": "16-true",
    "bf16-true": "bf16-true",
}
_VALID = '"32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true" (aliases 32, 64, 16, "bf16")'


def normalize_precision(precision: Any) -> str:
    """The canonical name of ``precision``; ValueError naming the value and the valid ones."""
    if isinstance(precision, bool):
        raise TypeError(f"precision={precision!r} is not valid; expected one of {_VALID}.")
    key = precision.lower() if isinstance(precision, str) else precision
    try:
        return PRECISION_ALIASES[key]
    except (KeyError, TypeError):
        raise ValueError(f"precision={precision!r} is not supported; expected one of {_VALID}.") from None


class Precision:
    """Full 32-bit precision; the base for the others.

    Hooks (every plugin): ``convert_module`` (once, in setup), ``convert_input`` / ``forward_context`` /
    ``convert_output`` (around every forward of a set-up module), ``module_init_context`` /
    ``tensor_init_context`` (``fabric.init_module()`` / ``init_tensor()``), ``backward``,
    ``unscale_gradients`` (before clipping), ``optimizer_step``, ``state_dict`` / ``load_state_dict``.
    """

    name = "32-true"
    #: dtype that parameters are converted to (None: left as they are)
    param_dtype: Optional[torch.dtype] = None
    #: dtype that floating-point inputs of a set-up module's ``forward`` are cast to, and whose outputs come back
    #: in the default dtype (None: inputs and outputs as they are)
    input_dtype: Optional[torch.dtype] = None
    #: True when ``loss.backward()`` would be wrong (the loss must be scaled): set-up modules then make
    #: ``loss.backward()`` raise and ask for ``fabric.backward(loss)``
    requires_fabric_backward: bool = False

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.param_dtype) if self.param_dtype is not None else module

    def convert_input(self, data: Any) -> Any:
        """Floating-point tensors in ``data`` cast to ``input_dtype`` (every mode but 32-true, as Lightning's
        plugins); other tensors and values unchanged."""
        return data if self.input_dtype is None else _cast_floats(data, self.input_dtype)

    def convert_output(self, data: Any) -> Any:
        """Floating-point tensors in ``data`` back in the default dtype where inputs were cast."""
        return data if self.input_dtype is None else _cast_floats(data, torch.get_default_dtype())

    def forward_context(self) -> ContextManager:
        """Around every forward: autocast (mixed) or the parameter dtype as default dtype (true modes)."""
        return _default_dtype(self.param_dtype) if self.param_dtype is not None else nullcontext()

    def module_init_context(self) -> ContextManager:
        return _default_dtype(self.param_dtype) if self.param_dtype is not None else nullcontext()

    def tensor_init_context(self) -> ContextManager:
        return self.module_init_context()

    @property
    def precision(self) -> str:
        """Lightning's name for ``name`` ("32-true", "bf16-mixed", ...)."""
        return self.name

    def pre_backward(self, tensor: Tensor, module: Optional[nn.Module]) -> Any:
        """Before ``backward`` (the strategy calls it): the tensor to run backward on."""
        return tensor

    def backward(self, tensor: Tensor, model: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        tensor.backward(*args, **kwargs)

    def post_backward(self, tensor: Tensor, module: Optional[nn.Module]) -> Any:
        """After ``backward`` (the strategy calls it)."""
        return tensor

    def main_params(self, optimizer: Optimizer) -> Iterator[Tensor]:
        """The parameters ``optimizer`` updates (what gradient clipping works on)."""
        return (p for group in optimizer.param_groups for p in group["params"])

    def teardown(self) -> None:
        """Release what the plugin holds (the strategy calls it at teardown)."""

    def guard_backward(self, tensor: Tensor) -> None:
        """Make ``tensor.backward()`` outside ``self.backward`` raise (for plugins that scale the loss)."""
        if tensor.requires_grad:
            tensor.register_hook(self._check_in_backward)

    def _check_in_backward(self, grad: Tensor) -> None:
        if not getattr(self, "_in_backward", False):
            raise RuntimeError(f"precision={self.name!r} scales the loss: call `fabric.backward(loss)` instead of "
                               "`loss.backward()`.")

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Undo loss scaling on ``optimizer``'s gradients (no-op without a scaler)."""

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        return optimizer.step(**kwargs)

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class DoublePrecision(Precision):
    """64-true: floating-point parameters, buffers, inputs and new tensors in float64; complex ones are left as
    they are (``Module.double()``, as Lightning)."""

    name = "64-true"
    param_dtype = torch.float64
    input_dtype = torch.float64

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.double()


class HalfPrecision(Precision):
    """16-true / bf16-true: parameters, inputs and new tensors in that dtype."""

    def __init__(self, precision: str = "16-true") -> None:
        self.name = precision
        self.param_dtype = self.input_dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16


class MixedPrecision(Precision):
    """16-mixed / bf16-mixed: autocast in forward, floating-point inputs cast to its dtype (as Lightning); a
    GradScaler for 16-mixed on cuda."""

    def __init__(self, precision: str, device: str, scaler: Optional["torch.amp.GradScaler"] = None) -> None:
        if precision not in ("16-mixed", "bf16-mixed"):
            # Lightning's exact message (lightning.fabric.plugins.precision.amp.MixedPrecision): aliases such as
            # "16", 16 and "bf16" are the Fabric(precision=...) argument's, not this plugin's.
            raise ValueError(
                f"Passed `{type(self).__name__}(precision={precision!r})`."
                " Precision must be '16-mixed' or 'bf16-mixed'."
            )
        if scaler is not None and precision == "bf16-mixed":
            raise ValueError(f"`precision='bf16-mixed'` does not use a scaler, found {scaler}.")
        if precision == "16-mixed" and device == "cpu":
            warnings.warn("precision='16-mixed' is not supported on CPU; using 'bf16-mixed' instead.", stacklevel=2)
            precision = "bf16-mixed"
        self.name = precision
        self.device = device
        self.dtype = self.input_dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
        if scaler is None and precision == "16-mixed" and device == "cuda":
            scaler = torch.amp.GradScaler("cuda")
        self.scaler = scaler
        self.requires_fabric_backward = scaler is not None
        self._in_backward = False

    def forward_context(self) -> ContextManager:
        return torch.autocast(self.device, dtype=self.dtype)

    def backward(self, tensor: Tensor, model: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        if self.scaler is None:
            tensor.backward(*args, **kwargs)
            return
        self._in_backward = True
        try:
            self.scaler.scale(tensor).backward(*args, **kwargs)
        finally:
            self._in_backward = False

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        if "closure" in kwargs and kwargs["closure"] is not None:
            raise ValueError("precision='16-mixed' with a GradScaler does not support optimizer.step(closure).")
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return result

    def state_dict(self) -> Dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


def precision_plugin(precision: Union[str, int], device_type: str) -> Precision:
    """The plugin for a (canonical or alias) precision value on ``device_type`` ("cpu", "cuda", ...)."""
    name = normalize_precision(precision)
    if name == "32-true":
        return Precision()
    if name == "64-true":
        return DoublePrecision()
    if name in ("16-true", "bf16-true"):
        return HalfPrecision(name)
    return MixedPrecision(name, "cuda" if device_type == "cuda" else "cpu")


def _cast_floats(data: Any, dtype: torch.dtype) -> Any:
    from lightning_utilities.core.apply_func import apply_to_collection

    return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
