"""``measure_flops``: FLOPs of a forward (and backward) pass, counted by torch's FlopCounterMode."""
from __future__ import annotations

from typing import Callable, Optional

import torch


def measure_flops(model: torch.nn.Module, forward_fn: Callable[[], torch.Tensor],
                  loss_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> int:
    """FLOPs of ``forward_fn()`` (which runs ``model``), plus ``loss_fn(output).backward()`` when ``loss_fn`` is
    given. A model and inputs on the meta device cost no memory or compute: ``with torch.device("meta"): ...``."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        if loss_fn is None:
            forward_fn()
        else:
            loss_fn(forward_fn()).backward()
    return counter.get_total_flops()
