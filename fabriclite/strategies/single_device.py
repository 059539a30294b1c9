"""One process on one device: set-up only moves; collectives are identities."""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from fabriclite.checkpoint.checkpoint_io import CheckpointIO
from fabriclite.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """Runs in the calling process on ``device`` (default: the accelerator's first device)."""

    name = "single_device"
    single_device = True

    def __init__(self, device: Union[str, torch.device, int] = "cpu", accelerator: Any = None,
                 checkpoint_io: Optional[CheckpointIO] = None, precision: Any = None, **kwargs: Any) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision, **kwargs)
        self._device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)

    @property
    def root_device(self) -> torch.device:
        return self._device

    def set_device(self, device: Optional[torch.device]) -> None:
        if device is not None:
            self._device = device
