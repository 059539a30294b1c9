"""How ``Fabric.setup`` / ``setup_module`` hook up a LightningModule, exactly as Lightning Fabric 2.6 does it.

Duck typing only (fabriclite never imports lightning): a module with a ``_fabric`` attribute is "probably a
LightningModule". ``setup`` sets its ``_fabric`` and ``_fabric_optimizers``; ``setup_module`` sets ``_fabric``
only; both add it to the Fabric's callbacks (once), so ``fabric.call("on_train_start")`` reaches its hooks.
Lightning's own ``self.log`` / ``self.log_dict`` / ``self.logger(s)`` / ``self.optimizers()`` /
``self.manual_backward`` / ``self.backward`` / ``self.trainer`` / ``self.all_gather`` then go to the Fabric.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence


def attach(fabric: Any, module: Any, callbacks: List[Any], optimizers: Optional[Sequence[Any]] = None) -> None:
    """Hook ``module`` (the one passed to setup, not its wrapper) up to ``fabric`` when it has ``_fabric``.

    ``optimizers``: the wrapped optimizers from ``setup`` (stored as ``_fabric_optimizers``); None from
    ``setup_module`` (nothing stored). ``callbacks``: the Fabric's callback list, appended to in place.
    """
    if type(module).__name__ == "OptimizedModule":  # torch.compile'd: hook up the module inside, as Lightning
        module = getattr(module, "_orig_mod", module)
    if not hasattr(module, "_fabric"):
        return
    module._fabric = fabric
    if optimizers is not None:
        module._fabric_optimizers = list(optimizers)
    if not any(callback is module for callback in callbacks):
        callbacks.append(module)
